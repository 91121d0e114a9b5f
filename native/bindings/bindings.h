// The pybind11 layer: one file per Python type, each converting arguments and results for the
// native core (native/core/) and releasing the GIL around native work.
#pragma once

#include "call_guard.h"
#include "ggml.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <optional>

namespace retro::bindings {

void bind_errors(pybind11::module_ & m);
void bind_runtime(pybind11::module_ & m);
void bind_model(pybind11::module_ & m);
void bind_context(pybind11::module_ & m);
void bind_trainer(pybind11::module_ & m);
void bind_hooks(pybind11::module_ & m);
void bind_transactions(pybind11::module_ & m);

// The context's call guard (native/core/call_guard.h), waited for without the GIL: the call it
// waits on may need the GIL for its callbacks.
class Busy {
public:
    explicit Busy(Context & c, CallGuard::Nesting nesting = CallGuard::Nesting::refused) {
        pybind11::gil_scoped_release release;
        guard_.emplace(c, nesting);
    }

private:
    std::optional<CallGuard> guard_;
};

// a float32 copy of a tensor (any backend), shaped outermost first
pybind11::array_t<float> tensor_to_numpy(const ggml_tensor * t);

}  // namespace retro::bindings
