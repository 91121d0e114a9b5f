// retro._native: the thin native layer. Python validates every input first (retro/), so each
// check here exists only to keep a native assert unreachable.
#include "errors.h"
#include "handles.h"
#include "logging.h"
#include "retro_training.h"
#include "retro-hooks.h"
#include "build_info.h"

#include "ggml-backend.h"
#include "llama.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>

namespace py = pybind11;
using namespace retro;

namespace {

const char * kind_name(ErrorKind k) {
    switch (k) {
        case ErrorKind::Load:          return "ModelLoadError";
        case ErrorKind::Context:       return "ContextError";
        case ErrorKind::Decode:        return "DecodeError";
        case ErrorKind::BatchInit:     return "BatchInitError";
        case ErrorKind::MemoryInit:    return "MemoryInitError";
        case ErrorKind::OutputReserve: return "OutputReserveError";
        case ErrorKind::GraphBuild:    return "GraphBuildError";
        case ErrorKind::Allocation:    return "AllocationError";
        case ErrorKind::Compute:       return "ComputeError";
        case ErrorKind::Poisoned:      return "PoisonedTrainerError";
        case ErrorKind::InvalidState:  return "InvalidStateError";
    }
    return "RetroError";
}

py::list devices() {
    py::list out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        const char * kind = "other";
        switch (ggml_backend_dev_type(dev)) {
            case GGML_BACKEND_DEVICE_TYPE_CPU:   kind = "cpu"; break;
            case GGML_BACKEND_DEVICE_TYPE_GPU:   kind = "gpu"; break;
            case GGML_BACKEND_DEVICE_TYPE_IGPU:  kind = "igpu"; break;
            case GGML_BACKEND_DEVICE_TYPE_ACCEL: kind = "accel"; break;
            default: break;
        }
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        out.append(py::dict(py::arg("index") = i, py::arg("name") = ggml_backend_dev_name(dev),
                            py::arg("description") = ggml_backend_dev_description(dev), py::arg("kind") = kind,
                            py::arg("backend") = reg ? ggml_backend_reg_name(reg) : "",
                            py::arg("memory_free") = free, py::arg("memory_total") = total));
    }
    return out;
}

// device_indices: None offloads to every device the build has; a list (possibly empty: CPU only) to those
std::shared_ptr<Model> load_model(const std::string & path, std::optional<std::vector<size_t>> device_indices,
                                  int32_t gpu_layers, bool trainable) {
    std::vector<ggml_backend_dev_t> devs;
    for (size_t i : device_indices.value_or(std::vector<size_t>{})) {
        if (i >= ggml_backend_dev_count()) {
            throw py::index_error("no device with index " + std::to_string(i));
        }
        devs.push_back(ggml_backend_dev_get(i));
    }
    devs.push_back(nullptr);
    llama_model_params params = llama_model_default_params();
    params.devices      = device_indices ? devs.data() : nullptr;
    params.n_gpu_layers = gpu_layers;
    // the optimizer writes the weights in place: a read-only mapping would fault on the first step
    params.load_mode    = trainable ? LLAMA_LOAD_MODE_NONE : params.load_mode;
    auto model = std::make_shared<Model>();
    model->trainable = trainable;
    clear_recent_errors();
    {
        py::gil_scoped_release release;
        model->model = llama_model_load_from_file(path.c_str(), params);
    }
    if (!model->model) {
        throw Error(ErrorKind::Load, with_diagnostic("failed to load the model from '" + path + "'"));
    }
    return model;
}

std::shared_ptr<Context> new_context(std::shared_ptr<Model> model, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch,
                                     int32_t n_threads) {
    llama_context_params params = llama_context_default_params();
    params.n_ctx           = n_ctx;
    params.n_batch         = n_batch;
    params.n_ubatch        = n_ubatch;
    params.n_seq_max       = 1;
    params.n_threads       = n_threads;
    params.n_threads_batch = n_threads;
    params.no_perf         = true;
    auto context = std::make_shared<Context>();
    context->model = model;
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
    llama_context * ctx = c.get();
    const int32_t n = (int32_t) tokens.size();
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(c.model->get()));
    if (tokens.ndim() != 1 || n <= 0 || (uint32_t) n > llama_n_batch(ctx) ||
            (int64_t) c.n_past + n > (int64_t) llama_n_ctx(ctx)) {
        throw std::invalid_argument("tokens must be 1-D, non-empty, at most n_batch long and fit the context");
    }
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
    {
        py::gil_scoped_release release;
        rc = llama_decode(ctx, batch);
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

std::vector<int32_t> tokenize(const Model & m, const std::string & text, bool add_special, bool parse_special) {
    const llama_vocab * vocab = llama_model_get_vocab(m.get());
    if (text.size() > (size_t) INT32_MAX / 2) {
        throw py::value_error("text too long to tokenize");
    }
    std::vector<int32_t> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
    if (n == INT32_MIN) {
        throw py::value_error("tokenization result too large");
    }
    if (n < 0) {
        out.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
    }
    out.resize(std::max(n, 0));
    return out;
}

py::bytes detokenize(const Model & m, const std::vector<int32_t> & tokens, bool render_special) {
    const llama_vocab * vocab = llama_model_get_vocab(m.get());
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (int32_t t : tokens) {
        if (t < 0 || t >= n_vocab) {
            throw std::invalid_argument("token id out of range");
        }
    }
    std::string text(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(), false, render_special);
    if (n < 0) {
        text.resize(-n);
        n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(), false, render_special);
    }
    text.resize(std::max(n, 0));
    return py::bytes(text);
}

std::vector<std::string> tensor_names(const Model & m) {
    std::vector<std::string> names;
    const int32_t n = llama_model_n_tensors(m.get());
    for (int32_t i = 0; i < n; ++i) {
        names.emplace_back(ggml_get_name(llama_model_get_tensor(m.get(), i)));
    }
    return names;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "retro native layer over the patched llama.cpp";
    llama_backend_init();
    install_log_sink();

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const Error & e) {
            py::object cls = py::module_::import("retro.errors").attr(kind_name(e.kind));
            PyErr_SetString(cls.ptr(), e.what());
        }
    });

    m.def("build_info", []() { return std::string(RETRO_BUILD_INFO); });
    m.def("devices", &devices);
    m.def("drain_logs", &drain_logs);
    m.def("recent_errors", &recent_errors);

    py::class_<Model, std::shared_ptr<Model>>(m, "Model")
        .def_static("load", &load_model, py::arg("path"), py::arg("devices"), py::arg("gpu_layers"), py::arg("trainable"))
        .def("close", &Model::close)
        .def_property_readonly("closed", [](const Model & self) { return self.model == nullptr; })
        .def_readonly("trainable", &Model::trainable)
        .def_property_readonly("n_vocab", [](const Model & self) { return llama_vocab_n_tokens(llama_model_get_vocab(self.get())); })
        .def_property_readonly("n_ctx_train", [](const Model & self) { return llama_model_n_ctx_train(self.get()); })
        .def_property_readonly("n_layer", [](const Model & self) { return llama_model_n_layer(self.get()); })
        .def_property_readonly("n_embd", [](const Model & self) { return llama_model_n_embd(self.get()); })
        .def("tokenize", &tokenize, py::arg("text"), py::arg("add_special"), py::arg("parse_special"))
        .def("detokenize", &detokenize, py::arg("tokens"), py::arg("render_special"))
        .def("tensor_names", &tensor_names)
        .def("tensor", [](const Model & self, const std::string & name) { return tensor_to_numpy(find_model_tensor(self.get(), name)); })
        .def("set_tensor", [](const Model & self, const std::string & name, py::array_t<float, py::array::c_style> values) {
            numpy_to_tensor(const_cast<ggml_tensor *>(find_model_tensor(self.get(), name)), values);
        })
        .def("save", [](const Model & self, const std::string & path) {
            clear_recent_errors();
            py::gil_scoped_release release;
            llama_model_save_to_file(self.get(), path.c_str());
        });

    py::class_<Context, std::shared_ptr<Context>>(m, "Context")
        .def(py::init(&new_context), py::arg("model"), py::arg("n_ctx"), py::arg("n_batch"), py::arg("n_ubatch"), py::arg("n_threads"))
        .def("close", &Context::close)
        .def_property_readonly("closed", [](const Context & self) { return self.ctx == nullptr; })
        .def_property_readonly("n_ctx", [](const Context & self) { return llama_n_ctx(self.get()); })
        .def_property_readonly("n_batch", [](const Context & self) { return llama_n_batch(self.get()); })
        .def_property_readonly("n_ubatch", [](const Context & self) { return llama_n_ubatch(self.get()); })
        .def_readonly("n_past", &Context::n_past)
        .def_property_readonly("sequence_length", [](const Context & self) {
            return llama_memory_seq_pos_max(llama_get_memory(self.get()), 0) + 1;
        })
        .def_readonly("has_trainer", &Context::has_trainer)
        .def("decode", &decode, py::arg("tokens"))
        .def("reset", [](Context & self) {
            llama_memory_clear(llama_get_memory(self.get()), true);
            self.n_past = 0;
        });

    bind_training(m);

    auto hooks = m.def_submodule("hooks", "fault sites and seeded-defect switches compiled into the fork");
    hooks.def("arm", &retro_fault_arm, py::arg("site"), py::arg("hit"), py::arg("persistent"));
    hooks.def("reset", &retro_fault_reset);
    hooks.def("hits", &retro_fault_hits, py::arg("site"));
    hooks.def("failures", &retro_fault_failures, py::arg("site"));
    hooks.def("mutant_on", &retro_mutant_on, py::arg("clause"));
    hooks.def("set_mutant", &retro_mutant_set, py::arg("clause"), py::arg("on"));
}
