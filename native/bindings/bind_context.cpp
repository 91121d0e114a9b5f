// retro._native.Context
#include "bindings.h"
#include "handles.h"
#include "logging.h"

#include <cstring>
#include <string>
#include <memory>

namespace py = pybind11;

namespace retro::bindings {
namespace {

std::shared_ptr<Context> new_context(std::shared_ptr<Model> model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch,
                                     int32_t n_threads, bool adaptive_threads) {
    llama_context_params params = llama_context_default_params();
    params.n_ctx                = n_ctx;
    params.n_batch              = n_batch;
    params.n_ubatch             = n_ubatch;
    params.n_seq_max            = 1;
    params.n_threads            = n_threads;
    params.n_threads_batch      = n_threads;
    params.no_perf              = true;
    auto context                = std::make_shared<Context>();
    context->model              = model;
    context->threads            = ThreadGovernor(n_threads, adaptive_threads);
    clear_recent_errors();
    {
        py::gil_scoped_release release;
        context->ctx = llama_init_from_model(model->get(), params);
    }
    if (!context->ctx) {
        throw Error(ErrorKind::Context, with_diagnostic("failed to create the context"));
    }
    model->open_contexts += 1;
    return context;
}

py::array_t<float> decode(Context & c, py::array_t<int32_t, py::array::c_style> tokens) {
    llama_context * ctx   = c.get();
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(c.model->get()));
    if (tokens.ndim() != 1 || tokens.size() <= 0 || (size_t) tokens.size() > llama_n_batch(ctx) ||
        (int64_t) c.n_past + tokens.size() > (int64_t) llama_n_ctx(ctx)) {
        throw std::invalid_argument("tokens must be 1-D, non-empty, at most n_batch long and fit the context");
    }
    const int32_t n   = (int32_t) tokens.size();
    llama_batch batch = llama_batch_init(n, 0, 1);
    std::unique_ptr<llama_batch, void (*)(llama_batch *)> guard(&batch, [](llama_batch * b) { llama_batch_free(*b); });
    const int32_t * tok = tokens.data();
    for (int32_t i = 0; i < n; ++i) {
        if (tok[i] < 0 || tok[i] >= n_vocab) {
            throw std::invalid_argument("token id out of range");
        }
        batch.token[i]     = tok[i];
        batch.pos[i]       = c.n_past + i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i]    = 1;
    }
    batch.n_tokens = n;
    clear_recent_errors();
    int32_t rc;
    std::string thrown;
    {
        py::gil_scoped_release release;
        c.threads.apply(ctx);
        try {
            rc = llama_decode(ctx, batch);
        } catch (const std::exception & e) {  // e.g. compute buffers that cannot be reserved
            rc     = -1;
            thrown = e.what();
        }
    }
    if (!thrown.empty()) {
        throw Error(ErrorKind::Decode, with_diagnostic("llama_decode failed: " + thrown));
    }
    if (rc != 0) {
        throw Error(ErrorKind::Decode, with_diagnostic("llama_decode returned " + std::to_string(rc)));
    }
    c.n_past += n;
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

}  // namespace

void bind_context(py::module_ & m) {
    py::class_<Context, std::shared_ptr<Context>>(m, "Context")
            .def(py::init(&new_context), py::arg("model"), py::arg("n_ctx"), py::arg("n_batch"), py::arg("n_ubatch"),
                 py::arg("n_threads"), py::arg("adaptive_threads"))
            .def_property_readonly("threads_now",
                                   [](const Context & self) { return llama_n_threads_batch(self.get()); })
            .def("close", &Context::close)
            .def_property_readonly("closed", [](const Context & self) { return self.ctx == nullptr; })
            .def_property_readonly("n_ctx", [](const Context & self) { return llama_n_ctx(self.get()); })
            .def_property_readonly("n_batch", [](const Context & self) { return llama_n_batch(self.get()); })
            .def_property_readonly("n_ubatch", [](const Context & self) { return llama_n_ubatch(self.get()); })
            .def_property_readonly("training_ubatch",
                                   [](const Context & self) { return training_geometry(self.get()).n_ubatch; })
            .def_readonly("n_past", &Context::n_past)
            .def_property_readonly(
                    "sequence_length",
                    [](const Context & self) { return llama_memory_seq_pos_max(llama_get_memory(self.get()), 0) + 1; })
            .def_readonly("has_trainer", &Context::has_trainer)
            .def("decode", &decode, py::arg("tokens"))
            .def("reset", [](Context & self) {
                llama_memory_clear(llama_get_memory(self.get()), true);
                self.n_past = 0;
            });
}

}  // namespace retro::bindings
