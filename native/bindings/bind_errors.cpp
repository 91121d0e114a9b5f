// Native errors to Python: each ErrorKind raises the class of the same name in retro.errors,
// which builds its classes from error_kinds() (one table, native/core/error_kinds.def).
#include "bindings.h"
#include "errors.h"
#include "tensor_io.h"

#include <pybind11/stl.h>

#include <tuple>
#include <vector>

namespace py = pybind11;

namespace retro::bindings {

py::array_t<float> tensor_to_numpy(const ggml_tensor * t) {
    std::vector<py::ssize_t> shape;
    for (int64_t n : tensor_shape(t)) {
        shape.push_back((py::ssize_t) n);
    }
    py::array_t<float> out(shape);
    read_f32(t, out.mutable_data());
    return out;
}

namespace {

// retro.errors' classes by name, handed over once when that module is imported. The translator
// then imports nothing: an import may release the GIL, and a call failing on a daemon thread while
// the interpreter exits must not (CPython ends a thread that asks for the GIL back mid-finalization,
// and that unwinding aborts the process in C++ frames). Leaked: it must outlive finalization.
py::dict * g_error_classes = nullptr;

}  // namespace

void bind_errors(py::module_ & m) {
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const Error & e) {
            PyObject * cls =
                    g_error_classes ? PyDict_GetItemString(g_error_classes->ptr(), python_class_of(e.kind)) : nullptr;
            if (cls) {
                PyErr_SetString(cls, e.what());
            } else {  // retro.errors not imported yet (it imports this module first)
                PyErr_SetString(py::module_::import("retro.errors").attr(python_class_of(e.kind)).ptr(), e.what());
            }
        }
    });
    m.def(
            "_set_error_classes", [](const py::dict & classes) { g_error_classes = new py::dict(classes); },
            "retro.errors hands over its classes, by name, once it has made them");
    m.def(
            "error_kinds",
            []() {
                std::size_t n               = 0;
                const ErrorKindInfo * kinds = error_kinds(&n);
                std::vector<std::tuple<std::string, std::string, std::string>> out;
                for (std::size_t i = 0; i < n; ++i) {
                    out.emplace_back(kinds[i].python_class, kinds[i].python_base, kinds[i].doc);
                }
                return out;
            },
            "(class, base, docstring) of every native error, bases first");
}

}  // namespace retro::bindings
