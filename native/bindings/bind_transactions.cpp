// retro._native.Transactions and the Python side of a tensor-transaction handler: the handler is
// called with the GIL taken in the data phase only, gets numpy copies, and every exception it
// raises is turned into text (type, bounded message and traceback) before native code sees it.
#include "bind_transactions.h"

#include "errors.h"
#include "retro-hooks.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>

namespace py = pybind11;

namespace retro::bindings {
namespace {

// The Python handler. A context is freed by Python (a close, a collection, or interpreter
// shutdown, when Py_IsInitialized() already reads false but the GIL is held): drop the reference
// then; take the GIL where it is not held; leak only once the interpreter is gone.
struct PyHandler {
    py::object fn;
    explicit PyHandler(py::object f) : fn(std::move(f)) {}
    ~PyHandler() {
        if (PyGILState_Check()) {
            fn = py::object();
        } else if (Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            fn = py::object();
        } else {
            fn.release();
        }
    }
};

// seeded defect TX-OWN-06: exceptions kept so that they could be raised again later
std::vector<py::object> & kept_exceptions() {
    static auto * kept = new std::vector<py::object>();
    return *kept;
}

std::string bounded(std::string text) {
    if (text.size() > tx::kMaxFailureText && !retro_defect_on(RETRO_DEFECT_TX_FAIL_01)) {  // seeded defect: unbounded
        const size_t cut = text.size() - tx::kMaxFailureText;
        text.resize(tx::kMaxFailureText);
        text += "... [" + std::to_string(cut) + " more characters]";
    }
    return text;
}

// str(), type name and traceback of an exception, none of which may raise in turn
tx::Failure describe(py::error_already_set & e) {
    tx::Failure f{"handler", "", "", "", ""};
    try {
        py::object type = e.type();
        f.type          = py::str(type.attr("__module__")).cast<std::string>() + "." +
                          py::str(type.attr("__qualname__")).cast<std::string>();
        if (retro_defect_on(RETRO_DEFECT_TX_FAIL_01_QUALNAME)) {  // seeded defect: the plain name
            f.type = py::str(type.attr("__module__")).cast<std::string>() + "." +
                     py::str(type.attr("__name__")).cast<std::string>();
        }
        if (f.type.size() > tx::kMaxFailureType) {
            f.type.resize(tx::kMaxFailureType);
        }
    } catch (...) {
        f.type = "<unnamed exception type>";
    }
    try {
        // seeded defect TX-FAIL-01.repr: the message is the exception's repr(), not its own text
        f.message = bounded((retro_defect_on(RETRO_DEFECT_TX_FAIL_01_REPR) ? py::repr(e.value()) : py::str(e.value()))
                                    .cast<std::string>());
    } catch (...) {
        f.message = "<the exception's str() raised>";
    }
    try {
        py::object lines = py::module_::import("traceback").attr("format_exception")(e.type(), e.value(), e.trace());
        f.traceback      = bounded(py::str("").attr("join")(lines).cast<std::string>());
        if (retro_defect_on(RETRO_DEFECT_TX_FAIL_01_TRACEBACK)) {  // seeded defect: the traceback unbounded
            f.traceback = py::str("").attr("join")(lines).cast<std::string>();
        }
    } catch (...) {
        f.traceback = "<the traceback could not be formatted>";
    }
    return f;
}

py::array owned_copy(const tx::Observation & obs, const tx::Selector & s) {
    const std::vector<py::ssize_t> shape{(py::ssize_t) obs.rows, (py::ssize_t) s.row_elements};
    py::array arr =
            s.dtype == tx::DType::F32 ? py::array(py::array_t<float>(shape)) : py::array(py::array_t<int32_t>(shape));
    // the array's own size: a copy never writes past the numpy buffer, whatever the node was
    std::memcpy(arr.mutable_data(), obs.data.data(), std::min((size_t) arr.nbytes(), obs.data.size()));
    if (s.access == tx::Access::Read) {  // numpy's flag, set directly: this runs in every data phase
        py::detail::array_proxy(arr.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    }
    return arr;
}

tx::Handler python_handler(py::object fn, const std::vector<tx::Selector> & selectors) {
    if (fn.is_none()) {
        return {};
    }
    auto holder = std::make_shared<PyHandler>(std::move(fn));
    return [holder, selectors](tx::Observation & obs) -> std::optional<tx::Failure> {
        py::gil_scoped_acquire gil;
        const tx::Selector & s = selectors[obs.selector];
        try {
            py::array data = owned_copy(obs, s);
            py::array_t<int32_t> positions((py::ssize_t) obs.rows);
            std::memcpy(positions.mutable_data(), obs.positions, sizeof(int32_t) * (size_t) obs.rows);
            if (retro_defect_on(RETRO_DEFECT_TX_OWN_06_POSITIONS_VIEW)) {  // seeded defect: a view of native storage
                positions = py::array_t<int32_t>((py::ssize_t) obs.rows, obs.positions, py::none());
            }
            holder->fn(s.name, obs.decode, obs.ubatch, obs.first_row, positions, data);
            if (s.access == tx::Access::MutableF32) {
                // the handler edits its copy in place; it must still be the array it was given
                bool shape_ok = data.ndim() == 2 && data.shape(0) == obs.rows && data.shape(1) == s.row_elements;
                if (retro_defect_on(RETRO_DEFECT_TX_ACC_10_ELEMENT_COUNT)) {  // seeded defect: the count alone
                    shape_ok = data.ndim() == 2 && data.shape(0) * data.shape(1) == obs.rows * s.row_elements;
                }
                bool type_ok = py::isinstance<py::array_t<float>>(data);
                if (retro_defect_on(RETRO_DEFECT_TX_ACC_10_ELEMENT_TYPE)) {  // seeded defect: any element type
                    type_ok = true;
                }
                if (!shape_ok || !type_ok || (size_t) data.nbytes() != obs.data.size() ||
                    !(data.flags() & py::array::c_style)) {
                    return tx::Failure{"handler", s.name, "", "the handler changed the shape or type of its array", ""};
                }
                std::memcpy(obs.data.data(), data.data(), obs.data.size());
            }
            return std::nullopt;
        } catch (py::error_already_set & e) {
            tx::Failure f = describe(e);
            f.node        = s.name;
            if (retro_defect_on(RETRO_DEFECT_TX_OWN_06)) {
                kept_exceptions().push_back(e.value());
            }
            return f;
        } catch (const std::exception & e) {
            return tx::Failure{"handler", s.name, "native", bounded(e.what()), ""};
        }
    };
}

std::vector<tx::Selector> to_selectors(const std::vector<py::tuple> & specs) {
    std::vector<tx::Selector> out;
    for (const auto & spec : specs) {
        tx::Selector s;
        s.name              = spec[0].cast<std::string>();
        s.dtype             = (tx::DType) spec[1].cast<int>();
        s.row_elements      = spec[2].cast<int64_t>();
        s.max_rows          = spec[3].cast<int64_t>();
        s.access            = (tx::Access) spec[4].cast<int>();
        s.retain            = spec[5].cast<bool>();
        s.rows              = (tx::Rows) spec[6].cast<int>();
        s.borrowed          = reinterpret_cast<void *>(spec[7].cast<uintptr_t>());
        s.borrowed_capacity = spec[8].cast<size_t>();
        if (s.name.empty() || s.name.size() > tx::kMaxNameLength || s.row_elements <= 0 ||
            s.row_elements > tx::kMaxRowElements || s.max_rows <= 0 || s.max_rows > tx::kMaxRows) {
            throw std::invalid_argument("selector out of bounds");
        }
        out.push_back(std::move(s));
    }
    if (out.empty() || out.size() > tx::kMaxSelectors) {
        throw std::invalid_argument("between 1 and 64 selectors");
    }
    return out;
}

py::tuple failure_tuple(const tx::Failure & f) {
    return py::make_tuple(f.kind, f.node, f.type, f.message, f.traceback);
}

}  // namespace

void bind_transactions(py::module_ & m) {
    py::class_<PendingTransactions, std::shared_ptr<PendingTransactions>>(m, "Transactions")
            .def(py::init([](const std::vector<py::tuple> & specs, py::object handler, size_t limit) {
                     auto selectors   = to_selectors(specs);
                     tx::Handler call = python_handler(std::move(handler), selectors);
                     return std::make_shared<PendingTransactions>(std::move(selectors), std::move(call), limit);
                 }),
                 py::arg("selectors"), py::arg("handler"), py::arg("retained_limit"))
            .def_property_readonly("address",
                                   [](const PendingTransactions & p) {
                                       if (retro_defect_on(RETRO_DEFECT_TX_OWN_01_ADDRESS)) {  // seeded defect
                                           return (uintptr_t) p.state.get();  // the pointer a context empties
                                       }
                                       return (uintptr_t) p.original;
                                   })
            .def_property_readonly("taken", [](const PendingTransactions & p) { return !p.state; });

    m.def(
            "tx_verify",
            [](const std::string & name, int type, std::array<int64_t, 4> ne, bool contiguous, py::tuple spec,
               int64_t expected_rows) -> py::object {
                const auto selectors = to_selectors({spec});
                const tx::Layout layout{(ggml_type) type, {ne[0], ne[1], ne[2], ne[3]}, contiguous, name.c_str()};
                size_t bytes = 0;
                if (auto f = tx::verify(layout, selectors[0], expected_rows, &bytes)) {
                    return failure_tuple(*f);
                }
                return py::int_(bytes);
            },
            "the data phase's checks on a node's metadata: its byte count, or the failure tuple");
}

py::object failure_or_none(const std::optional<tx::Failure> & f) {
    return f ? py::object(failure_tuple(*f)) : py::object(py::none());
}

py::list to_python(Drained drained) {
    py::list out;
    const auto & selectors = drained.selectors;
    for (auto & cap : drained.captures) {
        tx::Observation view{cap.selector, cap.decode, 0, 0, cap.rows, cap.positions.data(), std::move(cap.data)};
        // seeded defect TX-ACC-08.first-width: every capture shaped by the first selector
        const size_t shaped_by               = retro_defect_on(RETRO_DEFECT_TX_ACC_08_FIRST_WIDTH) ? 0 : cap.selector;
        py::array data                       = owned_copy(view, selectors[shaped_by]);
        data.attr("flags").attr("writeable") = true;
        py::array_t<int32_t> positions((py::ssize_t) cap.rows);
        std::memcpy(positions.mutable_data(), cap.positions.data(), sizeof(int32_t) * (size_t) cap.rows);
        out.append(py::make_tuple(selectors[cap.selector].name, cap.decode, positions, data));
    }
    return out;
}

}  // namespace retro::bindings
