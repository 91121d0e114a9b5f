// retro._native.Context
#include "bind_transactions.h"
#include "bindings.h"
#include "decoding.h"
#include "graph_probe.h"
#include "handles.h"
#include "logging.h"

#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>

namespace py = pybind11;

namespace retro::bindings {
namespace {

std::shared_ptr<Context> new_context(std::shared_ptr<Model> model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch,
                                     int32_t n_threads, bool adaptive_threads, uint32_t sequences,
                                     std::shared_ptr<PendingTransactions> transactions) {
    if (transactions && llama_context_params_size() != sizeof(llama_context_params)) {
        throw Error(ErrorKind::Context,
                    "the llama library was built from another llama.h (decode hooks ABI): rebuild retro");
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx                = n_ctx;
    params.n_batch              = n_batch;
    params.n_ubatch             = n_ubatch;
    // packed training puts several documents (sequences) in one micro-batch: one KV stream for
    // all of them, so that a micro-batch is never split by sequence
    params.n_seq_max       = std::max<uint32_t>(1, sequences);
    params.kv_unified      = sequences > 1;
    params.n_threads       = n_threads;
    params.n_threads_batch = n_threads;
    params.no_perf         = true;
    auto context           = std::make_shared<Context>();
    context->model         = model;
    context->threads       = ThreadGovernor(n_threads, adaptive_threads);
    if (transactions) {
        install(*context, params, *transactions);
    }
    clear_recent_errors();
    {
        WithoutGil release;
        context->ctx = llama_init_from_model(model->get(), params);
    }
    if (!context->ctx) {
        throw Error(ErrorKind::Context, with_diagnostic("failed to create the context"));
    }
    model->open_contexts += 1;
    return context;
}

std::string failure_text(const tx::Failure & f) {
    std::string text = "tensor transaction failed (" + f.kind + (f.node.empty() ? "" : ", node '" + f.node + "'") + ")";
    if (!f.type.empty()) {
        text += ": " + f.type;
    }
    return text + ": " + f.message;
}

// After a decode (or a generation's decodes) on c: raise what the transactions or llama.cpp report.
void check_outcome(Context & c, int32_t rc, int32_t n_past_before) {
    if (c.transactions) {
        const tx::Transactions & t = *c.transactions;
        if (t.last_refused()) {
            throw Error(ErrorKind::CaptureLimit, "the decode's retained captures would take the undrained ones past " +
                                                         std::to_string(t.retained_limit()) + " bytes (" +
                                                         std::to_string(t.retained_bytes()) +
                                                         " held): drain them first");
        }
        if (t.failed() && !retro_defect_on(RETRO_DEFECT_TX_FAIL_04)) {       // seeded defect: only rc is looked at
            if (retro_defect_on(RETRO_DEFECT_TX_FAIL_05) && t.last_ran()) {  // seeded defect: rolled back
                llama_memory_seq_rm(llama_get_memory(c.ctx), 0, n_past_before, -1);
                c.n_past = n_past_before;
            }
            throw Error(ErrorKind::TensorCallback, failure_text(t.failure()));
        }
    }
    if (rc != 0) {
        throw Error(ErrorKind::Decode, with_diagnostic("llama_decode returned " + std::to_string(rc)));
    }
}

py::array_t<float> decode(Context & c, py::array_t<int32_t, py::array::c_style> tokens) {
    Busy busy(c);
    llama_context * ctx   = c.get();
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(c.model->get()));
    if (tokens.ndim() != 1 || tokens.size() <= 0 || (size_t) tokens.size() > llama_n_batch(ctx) ||
        (int64_t) c.n_past + tokens.size() > (int64_t) llama_n_ctx(ctx)) {
        throw std::invalid_argument("tokens must be 1-D, non-empty, at most n_batch long and fit the context");
    }
    const int32_t n     = (int32_t) tokens.size();
    const int32_t * tok = tokens.data();
    for (int32_t i = 0; i < n; ++i) {
        if (tok[i] < 0 || tok[i] >= n_vocab) {
            throw std::invalid_argument("token id out of range");
        }
    }
    const int32_t before = c.n_past;
    clear_recent_errors();
    int32_t rc;
    std::string thrown;
    {
        WithoutGil release;
        const bool bracket = c.transactions && retro_defect_on(RETRO_DEFECT_TX_OWN_05);  // seeded defect
        if (bracket && !tx::Transactions::decode_begin(c.transactions.get(), n)) {
            rc = LLAMA_DECODE_HOOK_FAILED;
        } else {
            try {
                rc = decode_tokens(c, tok, n, std::vector<int8_t>((size_t) n, 1));
            } catch (const std::exception & e) {  // e.g. compute buffers that cannot be reserved
                rc     = -1;
                thrown = e.what();
            }
            if (bracket && !tx::Transactions::decode_end(c.transactions.get(), rc) && rc == 0) {
                rc = LLAMA_DECODE_HOOK_FAILED;
            }
        }
    }
    if (!thrown.empty()) {
        throw Error(ErrorKind::Decode, with_diagnostic("llama_decode failed: " + thrown));
    }
    check_outcome(c, rc, before);
    py::array_t<float> logits({(py::ssize_t) n, (py::ssize_t) n_vocab});
    float * out = logits.mutable_data();
    for (int32_t i = 0; i < n; ++i) {
        const float * row = llama_get_logits_ith(ctx, i);
        if (!row) {
            throw Error(ErrorKind::Decode, with_diagnostic("no logits for output " + std::to_string(i)));
        }
        std::memcpy(out + (size_t) i * n_vocab, row, sizeof(float) * n_vocab);
    }
    return logits;
}

// (tokens, decodes, drafted, accepted); a failed decode raises after the tokens generated so far
// are attached to the error as `.tokens`.
py::tuple generate(Context & c, const std::vector<int32_t> & prompt, int32_t max_new, float temperature, uint32_t seed,
                   bool stop_at_eog, std::shared_ptr<Context> draft, int32_t n_draft) {
    Busy busy(c);
    std::optional<Busy> draft_busy;
    if (draft) {
        draft_busy.emplace(*draft);
        draft->get();
    }
    c.get();
    const int32_t before       = c.n_past;
    const int32_t draft_before = draft ? draft->n_past : 0;
    clear_recent_errors();
    Generation g;
    // a pending signal (Ctrl-C) stops the generation at the next token: PyErr_CheckSignals leaves
    // its exception set on this thread, raised below with the tokens made so far
    const InterruptFn interrupted = [] {
        py::gil_scoped_acquire acquire;
        return PyErr_CheckSignals() != 0;
    };
    {
        WithoutGil release;
        g = retro::generate(c, prompt, max_new, Sampling{temperature, seed}, stop_at_eog, draft.get(), n_draft,
                            interrupted);
    }
    if (g.interrupted) {
        py::error_already_set e;
        e.value().attr("tokens") = py::cast(g.tokens);
        throw e;
    }
    if (g.failed) {
        try {
            // seeded defect HARNESS-04.handler: only the target's transactions are looked at
            Context & failed = retro_defect_on(RETRO_DEFECT_HARNESS_04_HANDLER) ? c : *g.failed;
            check_outcome(failed, g.status, &failed == &c ? before : draft_before);
        } catch (Error & e) {
            py::object cls     = py::module_::import("retro.errors").attr(python_class_of(e.kind));
            py::object err     = cls(e.what());
            err.attr("tokens") = py::cast(g.tokens);
            PyErr_SetObject(cls.ptr(), err.ptr());
            throw py::error_already_set();
        }
    }
    return py::make_tuple(g.tokens, g.decodes, g.drafted, g.accepted);
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
            .def(py::init(&new_context), py::arg("model"), py::arg("n_ctx"), py::arg("n_batch"), py::arg("n_ubatch"),
                 py::arg("n_threads"), py::arg("adaptive_threads"), py::arg("sequences"),
                 py::arg("transactions") = nullptr)
            .def_property_readonly("sequences", [](const Context & self) { return llama_n_seq_max(self.get()); })
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
                                   [](const Context & self) { return llama_n_threads_batch(self.get()); })
            .def("close",
                 [](Context & self) {
                     Busy busy(self);
                     self.close();
                 })
            .def_property_readonly("closed", [](const Context & self) { return self.ctx == nullptr; })
            // (address, capacity in floats) of the training steps' host label rows
            .def_property_readonly("label_rows",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       size_t capacity    = 0;
                                       const float * rows = llama_opt_label_rows(self.get(), &capacity);
                                       return py::make_tuple(reinterpret_cast<uintptr_t>(rows), capacity);
                                   })
            // capacity in elements of the fused head's host target arrays, all three together
            .def_property_readonly("sparse_target_capacity",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       return llama_opt_sparse_target_capacity(self.get());
                                   })
            .def_property_readonly("n_ctx", [](const Context & self) { return llama_n_ctx(self.get()); })
            .def_property_readonly("n_batch", [](const Context & self) { return llama_n_batch(self.get()); })
            .def_property_readonly("n_ubatch", [](const Context & self) { return llama_n_ubatch(self.get()); })
            .def_property_readonly("training_ubatch",
                                   [](const Context & self) { return training_geometry(self.get()).n_ubatch; })
            .def_readonly("n_past", &Context::n_past)
            .def_property_readonly("sequence_length",
                                   [](Context & self) {
                                       Busy busy(self, CallGuard::Nesting::allowed);
                                       return llama_memory_seq_pos_max(llama_get_memory(self.get()), 0) + 1;
                                   })
            .def_readonly("has_trainer", &Context::has_trainer)
            .def_property_readonly("callers", [](const Context & self) { return self.callers.load(); })
            .def("decode", &decode, py::arg("tokens"))
            .def("generate", &generate, py::arg("prompt"), py::arg("max_new"), py::arg("temperature"), py::arg("seed"),
                 py::arg("stop_at_eog"), py::arg("draft"), py::arg("n_draft"))
            .def("drain_captures",
                 [](Context & self) {
                     Busy busy(self);
                     return drain_captures(self);
                 })
            .def("transaction_failure",
                 [](Context & self) {
                     Busy busy(self);
                     return transaction_failure(self);
                 })
            .def_property_readonly("transactions_address",
                                   [](const Context & self) { return (uintptr_t) self.transactions.get(); })
            .def_property_readonly(
                    "eval_callback_user_data",
                    [](const Context & self) { return (uintptr_t) llama_get_eval_callback_user_data(self.get()); })
            .def_property_readonly(
                    "retained_bytes",
                    [](const Context & self) { return self.transactions ? self.transactions->retained_bytes() : 0; })
            .def_property_readonly(
                    "decodes",
                    [](const Context & self) { return self.transactions ? self.transactions->decodes() : 0; })
            .def("sequence_state",
                 [](Context & self) {
                     // llama.cpp's own serialization of sequence 0 (positions and K/V): what the
                     // context will compute on from here
                     Busy busy(self);
                     const size_t size = llama_state_seq_get_size(self.get(), 0);
                     std::string out(size, '\0');
                     const size_t n = llama_state_seq_get_data(self.get(), (uint8_t *) out.data(), size, 0);
                     out.resize(n);
                     return py::bytes(out);
                 })
            .def("reset", [](Context & self) {
                Busy busy(self);
                llama_memory_clear(llama_get_memory(self.get()), true);
                self.n_past = 0;
                if (self.transactions && retro_defect_on(RETRO_DEFECT_TX_FAIL_06_RESET)) {
                    self.transactions->forget_failure();  // seeded defect: a reset starts the transactions afresh
                }
            });
}

}  // namespace retro::bindings
