// retro._native.Context
#include "bind_transactions.h"
#include "bindings.h"
#include "context_calls.h"
#include "graph_probe.h"
#include "handles.h"
#include "logging.h"

#include <pybind11/stl.h>

#include <climits>
#include <memory>
#include <optional>
#include <string>

namespace py = pybind11;

namespace retro::bindings {
namespace {

py::array_t<float> decode(Context & c, py::array_t<int32_t, py::array::c_style> tokens) {
    if (tokens.ndim() != 1 || tokens.size() > INT32_MAX) {
        throw std::invalid_argument("tokens must be 1-D, at most n_batch long");
    }
    Logits logits;
    {
        WithoutGil release;
        logits = retro::decode(c, tokens.data(), (int32_t) tokens.size());
    }
    auto * values = new std::vector<float>(std::move(logits.values));
    py::capsule owner(values, [](void * p) { delete static_cast<std::vector<float> *>(p); });
    return py::array_t<float>({(py::ssize_t) logits.rows, (py::ssize_t) logits.n_vocab}, values->data(), owner);
}

// (tokens, decodes, drafted, accepted); Ctrl-C stops the generation at the next token and raises
// KeyboardInterrupt with `.tokens`, the tokens made so far.
py::tuple generate(Context & c, const std::vector<int32_t> & prompt, int32_t max_new, float temperature, uint32_t seed,
                   bool stop_at_eog, std::shared_ptr<Context> draft, int32_t n_draft) {
    // a pending signal: PyErr_CheckSignals leaves its exception set on this thread, raised below
    const InterruptFn interrupted = [] {
        py::gil_scoped_acquire acquire;
        return PyErr_CheckSignals() != 0;
    };
    Generation g;
    {
        WithoutGil release;
        g = generate_on(c, prompt, max_new, Sampling{temperature, seed}, stop_at_eog, draft.get(), n_draft,
                        interrupted);
    }
    if (g.interrupted) {
        py::error_already_set e;
        e.value().attr("tokens") = py::cast(g.tokens);
        throw e;
    }
    return py::make_tuple(g.tokens, g.decodes, g.drafted, g.accepted);
}

// A read of the context's state, under its call guard: a close from another thread cannot free
// what it reads (a read from the thread inside a call, a callback's, nests).
template <class Read>
auto guarded(Read read) {
    return [read](Context & self) {
        Busy busy(self, CallGuard::Nesting::allowed);
        return read(self);
    };
}

}  // namespace

void bind_context(py::module_ & m) {
    m.def(
            "probe_graph",
            [](const Model & model, int32_t n_tokens, int32_t n_outputs, int32_t n_threads) {
                std::vector<GraphNode> nodes;
                {
                    WithoutGil release;
                    nodes = probe_graph(model.get(), n_tokens, n_outputs, n_threads);
                }
                py::list out;
                for (const auto & n : nodes) {
                    out.append(py::make_tuple(n.name, ggml_type_name((ggml_type) n.type),
                                              py::make_tuple(n.ne[0], n.ne[1], n.ne[2], n.ne[3]), n.contiguous,
                                              n.device));
                }
                return out;
            },
            py::arg("model"), py::arg("n_tokens"), py::arg("n_outputs"), py::arg("n_threads"));
    py::class_<Context, std::shared_ptr<Context>>(m, "Context")
            .def(py::init([](std::shared_ptr<Model> model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch,
                             int32_t n_threads, bool adaptive_threads, uint32_t sequences,
                             std::shared_ptr<PendingTransactions> transactions) {
                     WithoutGil release;
                     return open_context(std::move(model),
                                         {n_ctx, n_batch, n_ubatch, n_threads, adaptive_threads, sequences},
                                         transactions.get());
                 }),
                 py::arg("model"), py::arg("n_ctx"), py::arg("n_batch"), py::arg("n_ubatch"), py::arg("n_threads"),
                 py::arg("adaptive_threads"), py::arg("sequences"), py::arg("transactions") = nullptr)
            .def_property_readonly("sequences", guarded([](Context & self) { return llama_n_seq_max(self.get()); }))
            // the packed batch of the last training step as llama.cpp holds it: (address of its
            // positions, positions, sequence ids)
            .def_property_readonly("packed_batch",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       const llama_pos * pos    = nullptr;
                                       const llama_seq_id * seq = nullptr;
                                       const int32_t n          = llama_opt_packed_batch(self.get(), &pos, &seq);
                                       return py::make_tuple(reinterpret_cast<uintptr_t>(pos),
                                                             py::array_t<int32_t>(n, pos),
                                                             py::array_t<int32_t>(n, seq));
                                   })
            // tokens the last training step's graph computed, as llama.cpp split the micro-batch
            .def_property_readonly("last_step_tokens",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       return llama_opt_last_step_times(self.get()).n_tokens;
                                   })
            // nodes of the forward graph the last training step built (0: it built none, the
            // packed-topology cache ran its entry's graphs)
            .def_property_readonly("last_step_forward_nodes",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       return llama_opt_last_step_times(self.get()).n_forward_nodes;
                                   })
            .def_property_readonly("threads_now",
                                   guarded([](Context & self) { return llama_n_threads_batch(self.get()); }))
            .def("close", &retro::close, py::call_guard<WithoutGil>())
            .def_property_readonly("closed", [](const Context & self) { return self.ctx == nullptr; })
            // (address, capacity in elements) of the host arrays of the training steps' targets
            .def_property_readonly("target_arrays",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       size_t capacity      = 0;
                                       const void * indices = llama_opt_target_arrays(self.get(), &capacity);
                                       return py::make_tuple(reinterpret_cast<uintptr_t>(indices), capacity);
                                   })
            .def_property_readonly("n_ctx", guarded([](Context & self) { return llama_n_ctx(self.get()); }))
            .def_property_readonly("n_batch", guarded([](Context & self) { return llama_n_batch(self.get()); }))
            .def_property_readonly("n_ubatch", guarded([](Context & self) { return llama_n_ubatch(self.get()); }))
            .def_property_readonly("training_ubatch",
                                   guarded([](Context & self) { return training_geometry(self.get()).n_ubatch; }))
            .def_readonly("n_past", &Context::n_past)
            .def_property_readonly("sequence_length",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       return llama_memory_seq_pos_max(llama_get_memory(self.get()), 0) + 1;
                                   })
            .def_readonly("has_trainer", &Context::has_trainer)
            .def_property_readonly("callers", [](const Context & self) { return self.calls.callers.load(); })
            .def("decode", &decode, py::arg("tokens"))
            .def("generate", &generate, py::arg("prompt"), py::arg("max_new"), py::arg("temperature"), py::arg("seed"),
                 py::arg("stop_at_eog"), py::arg("draft"), py::arg("n_draft"))
            .def("drain_captures",
                 [](Context & self) {
                     Drained drained;
                     {
                         WithoutGil release;
                         drained = drain_captures(self);
                     }
                     return to_python(std::move(drained));
                 })
            .def("transaction_failure",
                 [](Context & self) {
                     std::optional<tx::Failure> failure;
                     {
                         WithoutGil release;
                         failure = transaction_failure(self);
                     }
                     return failure_or_none(failure);
                 })
            .def_property_readonly("transactions_address",
                                   [](const Context & self) { return (uintptr_t) self.transactions.get(); })
            .def_property_readonly("eval_callback_user_data", guarded([](Context & self) {
                                       return (uintptr_t) llama_get_eval_callback_user_data(self.get());
                                   }))
            .def_property_readonly("retained_bytes", guarded([](Context & self) {
                                       return self.transactions ? self.transactions->retained_bytes() : 0;
                                   }))
            .def_property_readonly("decodes", guarded([](Context & self) {
                                       return self.transactions ? self.transactions->decodes() : 0;
                                   }))
            .def("sequence_state",
                 [](Context & self) {
                     std::string state;
                     {
                         WithoutGil release;
                         state = sequence_state(self);
                     }
                     return py::bytes(state);
                 })
            .def("reset", &retro::reset, py::call_guard<WithoutGil>());
}

}  // namespace retro::bindings
