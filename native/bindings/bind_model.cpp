// retro._native.Model
#include "bindings.h"
#include "handles.h"
#include "logging.h"
#include "tensor_io.h"

#include "ggml-backend.h"

#include <pybind11/stl.h>

#include <optional>
#include <vector>

namespace py = pybind11;

namespace retro::bindings {
namespace {

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
    params.devices            = device_indices ? devs.data() : nullptr;
    params.n_gpu_layers       = gpu_layers;
    // the optimizer writes the weights in place: a read-only mapping would fault on the first step
    params.load_mode = trainable ? LLAMA_LOAD_MODE_NONE : params.load_mode;
    auto model       = std::make_shared<Model>();
    model->trainable = trainable;
    clear_recent_errors();
    {
        WithoutGil release;
        model->model = llama_model_load_from_file(path.c_str(), params);
    }
    if (!model->model) {
        throw Error(ErrorKind::Load, with_diagnostic("failed to load the model from '" + path + "'"));
    }
    return model;
}

std::vector<int32_t> tokenize(const Model & m, const std::string & text, bool add_special, bool parse_special) {
    const llama_vocab * vocab = llama_model_get_vocab(m.get());
    // the int32 lengths of llama_tokenize: the text and its worst-case token count must fit
    if (text.size() > (size_t) INT32_MAX / 2) {
        throw py::value_error("text too long to tokenize");
    }
    std::vector<int32_t> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                               parse_special);
    if (n == INT32_MIN) {
        throw py::value_error("tokenization result too large");
    }
    if (n < 0) {
        out.resize(-(int64_t) n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                           parse_special);
    }
    out.resize(std::max(n, 0));
    return out;
}

py::bytes detokenize(const Model & m, const std::vector<int32_t> & tokens, bool render_special) {
    const llama_vocab * vocab = llama_model_get_vocab(m.get());
    const int32_t n_vocab     = llama_vocab_n_tokens(vocab);
    // int32 counts: the token count and the text buffer (8 bytes a token) must fit
    if (tokens.size() > (size_t) (INT32_MAX - 16) / 8) {
        throw py::value_error("too many tokens to detokenize at once");
    }
    for (int32_t t : tokens) {
        if (t < 0 || t >= n_vocab) {
            throw std::invalid_argument("token id out of range");
        }
    }
    std::string text(tokens.size() * 8 + 16, '\0');
    int32_t n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(),
                                 false, render_special);
    if (n < 0) {
        text.resize(-(int64_t) n);
        n = llama_detokenize(vocab, tokens.data(), (int32_t) tokens.size(), text.data(), (int32_t) text.size(), false,
                             render_special);
    }
    text.resize(std::max(n, 0));
    return py::bytes(text);
}

ggml_tensor * named_tensor(const Model & m, const std::string & name) {
    ggml_tensor * t = find_model_tensor(m.get(), name);
    if (!t) {
        throw py::key_error("no tensor named '" + name + "' in the model");
    }
    return t;
}

}  // namespace

void bind_model(py::module_ & m) {
    py::class_<Model, std::shared_ptr<Model>>(m, "Model")
            .def_static("load", &load_model, py::arg("path"), py::arg("devices"), py::arg("gpu_layers"),
                        py::arg("trainable"))
            .def("close",
                 [](Model & self) {
                     // not while a save or another thread's read of the weights is running on it
                     WeightsBusy weights(self, WeightsGuard::Nesting::refused);
                     self.close();
                 })
            .def_property_readonly("closed", [](const Model & self) { return self.model == nullptr; })
            .def_readonly("trainable", &Model::trainable)
            .def_property_readonly(
                    "n_vocab",
                    [](const Model & self) { return llama_vocab_n_tokens(llama_model_get_vocab(self.get())); })
            .def_property_readonly("n_ctx_train",
                                   [](const Model & self) { return llama_model_n_ctx_train(self.get()); })
            .def_property_readonly("n_layer", [](const Model & self) { return llama_model_n_layer(self.get()); })
            .def_property_readonly("n_embd", [](const Model & self) { return llama_model_n_embd(self.get()); })
            .def_property_readonly("architecture",
                                   [](const Model & self) {
                                       char buf[128] = {};
                                       const int n   = llama_model_meta_val_str(self.get(), "general.architecture", buf,
                                                                                sizeof(buf));
                                       return std::string(n > 0 ? buf : "");
                                   })
            .def("tokenize", &tokenize, py::arg("text"), py::arg("add_special"), py::arg("parse_special"))
            .def("detokenize", &detokenize, py::arg("tokens"), py::arg("render_special"))
            .def("tensor_names",
                 [](const Model & self) {
                     std::vector<std::string> names;
                     for (int32_t i = 0; i < llama_model_n_tensors(self.get()); ++i) {
                         names.emplace_back(ggml_get_name(llama_model_get_tensor(self.get(), i)));
                     }
                     return names;
                 })
            .def("tensor_devices",
                 [](const Model & self) {
                     // where each weight lives: the device of its buffer's type, read from ggml
                     py::dict out;
                     for (int32_t i = 0; i < llama_model_n_tensors(self.get()); ++i) {
                         const ggml_tensor * t          = llama_model_get_tensor(self.get(), i);
                         const char * where             = tensor_device_name(t);
                         out[py::str(ggml_get_name(t))] = where;
                     }
                     return out;
                 })
            .def("tensor_buffers",
                 [](const Model & self) {
                     // what memory each weight lives in: its buffer type's name, and whether that is
                     // host memory (a backend may name its GPU device for pinned host buffers)
                     py::dict out;
                     for (int32_t i = 0; i < llama_model_n_tensors(self.get()); ++i) {
                         const ggml_tensor * t              = llama_model_get_tensor(self.get(), i);
                         const ggml_backend_buffer_t buffer = t->view_src ? t->view_src->buffer : t->buffer;
                         ggml_backend_buffer_type_t type    = buffer ? ggml_backend_buffer_get_type(buffer) : nullptr;
                         out[py::str(ggml_get_name(t))]     = py::make_tuple(type ? ggml_backend_buft_name(type) : "",
                                                                             type && ggml_backend_buft_is_host(type));
                     }
                     return out;
                 })
            // every read and write of the weights waits for a training call on them (call_guard.h);
            // a read may nest in that call's callbacks, a write may not
            .def("tensor",
                 [](Model & self, const std::string & name) {
                     WeightsBusy weights(self, WeightsGuard::Nesting::allowed);
                     return tensor_to_numpy(named_tensor(self, name));
                 })
            .def("parameters",
                 [](Model & self) {
                     WeightsBusy weights(self, WeightsGuard::Nesting::allowed);
                     py::dict out;  // one step's weights, all of them
                     for (int32_t i = 0; i < llama_model_n_tensors(self.get()); ++i) {
                         const ggml_tensor * t          = llama_model_get_tensor(self.get(), i);
                         out[py::str(ggml_get_name(t))] = tensor_to_numpy(t);
                     }
                     return out;
                 })
            .def("set_tensor",
                 [](Model & self, const std::string & name, py::array_t<float, py::array::c_style> values) {
                     WeightsBusy weights(self, WeightsGuard::Nesting::refused);
                     write_f32(named_tensor(self, name), values.data(), (size_t) values.size());
                 })
            .def("save", [](Model & self, const std::string & path) {
                clear_recent_errors();
                WithoutGil release;
                WeightsGuard weights(self, WeightsGuard::Nesting::allowed);
                llama_model_save_to_file(self.get(), path.c_str());
            });
}

}  // namespace retro::bindings
