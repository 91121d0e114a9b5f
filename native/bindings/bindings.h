// The pybind11 layer: one file per Python type, each converting arguments and results for the
// native core (native/core/) and releasing the GIL around native work.
#pragma once

#include "ggml.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace retro::bindings {

void bind_errors(pybind11::module_ & m);
void bind_runtime(pybind11::module_ & m);
void bind_model(pybind11::module_ & m);
void bind_context(pybind11::module_ & m);
void bind_trainer(pybind11::module_ & m);
void bind_hooks(pybind11::module_ & m);
void bind_transactions(pybind11::module_ & m);

// a float32 copy of a tensor (any backend), shaped outermost first
pybind11::array_t<float> tensor_to_numpy(const ggml_tensor * t);

}  // namespace retro::bindings
