// Native errors to Python: each ErrorKind raises the class of the same name in retro.errors,
// which builds its classes from error_kinds() (one table, native/core/error_kinds.def).
#include "bindings.h"
#include "context_calls.h"
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

py::object error_class(ErrorKind kind) {
    if (g_error_classes) {
        if (PyObject * cls = PyDict_GetItemString(g_error_classes->ptr(), python_class_of(kind))) {
            return py::reinterpret_borrow<py::object>(cls);
        }
    }
    // retro.errors not imported yet (it imports this module first)
    return py::module_::import("retro.errors").attr(python_class_of(kind));
}

// The one Python error of a failed context call: its class, with the failed transaction's fields
// (read as `failure`, retro/errors.py) and a generation's `tokens` where the core reported them.
// Made in C calls only: no Python code runs here, so a daemon thread never gives up the GIL.
void raise(const CallError & e) {
    py::object cls = error_class(e.kind);
    try {
        py::object error = cls(e.what());
        if (e.failure) {
            const tx::Failure & f         = *e.failure;
            error.attr("_failure_fields") = py::make_tuple(f.kind, f.node, f.type, f.message, f.traceback);
        }
        if (e.tokens) {
            error.attr("tokens") = py::cast(*e.tokens);
        }
        PyErr_SetObject(cls.ptr(), error.ptr());
    } catch (py::error_already_set & failed) {
        failed.restore();  // making the error failed: that failure is raised instead
    }
}

}  // namespace

void bind_errors(py::module_ & m) {
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const CallError & e) {
            raise(e);
        } catch (const Error & e) {
            PyErr_SetString(error_class(e.kind).ptr(), e.what());
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
