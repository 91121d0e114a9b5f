// Copies between model or optimizer tensors (on any backend) and caller-owned host memory.
#pragma once

#include "ggml.h"
#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace retro {

// the tensor's shape, outermost dimension first (numpy order)
std::vector<int64_t> tensor_shape(const ggml_tensor * t);

// write every element of `t` as float32 into `out` (ggml_nelements(t) floats); a type without a
// float conversion throws std::invalid_argument
void read_f32(const ggml_tensor * t, float * out);

// overwrite an f32 tensor with exactly ggml_nelements(t) floats
void write_f32(ggml_tensor * t, const float * values, std::size_t count);

// the device whose memory holds the tensor (a view: its source's), from its buffer's type; "CPU"
// for host memory that names no device (the loader's own buffers), "" when it has no buffer yet
const char * tensor_device_name(const ggml_tensor * t);

// a weight of the model by name, nullptr when there is none
ggml_tensor * find_model_tensor(const llama_model * model, const std::string & name);

}  // namespace retro
