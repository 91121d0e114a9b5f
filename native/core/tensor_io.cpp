#include "tensor_io.h"

#include "defects.h"
#include "ggml-backend.h"

#include <stdexcept>

namespace retro {

std::vector<int64_t> tensor_shape(const ggml_tensor * t) {
    std::vector<int64_t> shape;
    for (int d = ggml_n_dims(t) - 1; d >= 0; --d) {
        shape.push_back(t->ne[d]);
    }
    return shape;
}

void read_f32(const ggml_tensor * t, float * out) {
    const int64_t n = ggml_nelements(t);
    if (t->type == GGML_TYPE_F32) {
        if (retro_defect_on(RETRO_DEFECT_BASE_03) && n > 1) {
            // seeded defect: a copy one element short (a size computed in elements, used in bytes)
            ggml_backend_tensor_get(t, out, 0, ggml_nbytes(t) - sizeof(float));
            out[n - 1] = 0.0f;
            return;
        }
        ggml_backend_tensor_get(t, out, 0, ggml_nbytes(t));
        return;
    }
    const auto * traits = ggml_get_type_traits(t->type);
    if (!traits->to_float || !ggml_is_contiguous(t)) {
        throw std::invalid_argument(std::string("cannot read a tensor of type ") + ggml_type_name(t->type) +
                                    " as float32");
    }
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    traits->to_float(raw.data(), out, n);
}

void write_f32(ggml_tensor * t, const float * values, std::size_t count) {
    if (t->type != GGML_TYPE_F32 || (int64_t) count != ggml_nelements(t)) {
        throw std::invalid_argument("cannot write " + std::to_string(count) + " float32 values into tensor '" +
                                    ggml_get_name(t) + "'");
    }
    ggml_backend_tensor_set(t, values, 0, ggml_nbytes(t));
}

ggml_tensor * find_model_tensor(const llama_model * model, const std::string & name) {
    const int32_t n = llama_model_n_tensors(model);
    for (int32_t i = 0; i < n; ++i) {
        ggml_tensor * t = llama_model_get_tensor(model, i);
        if (t && name == ggml_get_name(t)) {
            return t;
        }
    }
    return nullptr;
}

const char * tensor_device_name(const ggml_tensor * t) {
    const ggml_backend_buffer_t buffer = t->view_src ? t->view_src->buffer : t->buffer;
    ggml_backend_buffer_type_t type    = buffer ? ggml_backend_buffer_get_type(buffer) : nullptr;
    ggml_backend_dev_t dev             = type ? ggml_backend_buft_get_device(type) : nullptr;
    return dev ? ggml_backend_dev_name(dev) : type && ggml_backend_buft_is_host(type) ? "CPU" : "";
}

}  // namespace retro
