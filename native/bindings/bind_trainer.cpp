// retro._native.Trainer, OptimizerSettings, EpochMetrics
#include "bindings.h"
#include "tensor_io.h"
#include "trainer.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <optional>

namespace py = pybind11;

namespace retro::bindings {
namespace {

using Int32Array = py::array_t<int32_t, py::array::c_style>;
using FloatArray = py::array_t<float, py::array::c_style>;

// the windows of one epoch call; the arrays stay borrowed for the synchronous call. labels are
// [n_windows][width] or [n_windows][width][k] target ids; weights, if given, have their shape.
EpochRequest request_of(const Int32Array & tokens, const Int32Array & labels, const std::optional<FloatArray> & weights,
                        int64_t n_train, double duty_cycle) {
    if (tokens.ndim() != 2 || (labels.ndim() != 2 && labels.ndim() != 3) || tokens.shape(0) != labels.shape(0) ||
        tokens.shape(1) != labels.shape(1)) {
        throw std::invalid_argument("tokens and labels must be 2-D arrays of one shape");
    }
    const int64_t k = labels.ndim() == 3 ? labels.shape(2) : 1;
    if (weights && (weights->ndim() != labels.ndim() || weights->size() != labels.size())) {
        throw std::invalid_argument("weights must have the shape of the targets");
    }
    EpochRequest r;
    r.tokens     = tokens.data();
    r.labels     = labels.data();
    r.weights    = weights ? weights->data() : nullptr;
    r.k          = (int32_t) std::clamp<int64_t>(k, 0, LLAMA_OPT_MAX_TARGETS + 1);  // the core refuses out of range
    r.n_windows  = tokens.shape(0);
    r.width      = tokens.shape(1);
    r.n_train    = n_train;
    r.duty_cycle = duty_cycle;
    return r;
}

// A Python object that any thread may hold: it is released under the GIL whichever thread drops
// the last reference (the core keeps callbacks in scopes it may pop without the GIL).
std::shared_ptr<py::object> held_by_native(const py::object & o) {
    return std::shared_ptr<py::object>(new py::object(o), [](py::object * p) {
        py::gil_scoped_acquire acquire;
        delete p;
    });
}

// A Python progress callback as the core's ProgressFn, called with the GIL taken.
std::shared_ptr<const ProgressFn> progress_of(const py::object & progress) {
    if (progress.is_none()) {
        return nullptr;
    }
    return std::make_shared<const ProgressFn>(
            [held = held_by_native(progress)](bool train, int64_t done, int64_t total) {
                py::gil_scoped_acquire acquire;
                return !(*held)(train, done, total).is(py::bool_(false));
            });
}

// A Python schedule as the core's ScheduleFn, called with the GIL taken.
std::shared_ptr<const ScheduleFn> schedule_of(const py::object & schedule) {
    if (schedule.is_none()) {
        return nullptr;
    }
    return std::make_shared<const ScheduleFn>([held = held_by_native(schedule)](int64_t step, int64_t horizon) {
        py::gil_scoped_acquire acquire;
        return (*held)(step, horizon).cast<float>();
    });
}

EpochMetrics epoch(Trainer & t, const Int32Array & tokens, const Int32Array & labels,
                   const std::optional<FloatArray> & weights, int64_t n_train, const py::object & progress,
                   uintptr_t epoch_callback, double duty_cycle) {
    EpochRequest r   = request_of(tokens, labels, weights, n_train, duty_cycle);
    r.progress       = progress_of(progress);
    r.epoch_callback = reinterpret_cast<ggml_opt_epoch_callback>(epoch_callback);
    py::gil_scoped_release release;
    return t.epoch(r);
}

EpochMetrics upstream_epoch(Trainer & t, const Int32Array & tokens, const Int32Array & labels, int64_t n_train) {
    const EpochRequest r = request_of(tokens, labels, std::nullopt, n_train, 1.0);
    EpochMetrics m;
    py::gil_scoped_release release;
    t.upstream_epoch(r, m);
    return m;
}

// which: -1 the gradient accumulator, 0/1 the AdamW moments
ggml_tensor * state_of(Trainer & t, const std::string & name, int which) {
    if (!t.closed() && !find_model_tensor(t.context()->model->get(), name)) {
        throw py::key_error("no tensor named '" + name + "' in the model");
    }
    return t.state_tensor(name, which);
}

py::object read_state(Trainer & t, const std::string & name, int which) {
    Busy busy(t.held(), CallGuard::Nesting::allowed);
    const ggml_tensor * s = state_of(t, name, which);
    return s ? py::object(tensor_to_numpy(s)) : py::object(py::none());
}

// a read of the trainer's state, guarded: it may nest in a callback of a call on the context
template <typename R>
auto reading(R (Trainer::*read)()) {
    return [read](Trainer & t) {
        Busy busy(t.held(), CallGuard::Nesting::allowed);
        return (t.*read)();
    };
}

}  // namespace

void bind_trainer(py::module_ & m) {
    py::enum_<ggml_opt_optimizer_type>(m, "OptimizerType")
            .value("ADAMW", GGML_OPT_OPTIMIZER_TYPE_ADAMW)
            .value("SGD", GGML_OPT_OPTIMIZER_TYPE_SGD);

    py::class_<OptimizerSettings>(m, "OptimizerSettings")
            .def(py::init<>())
            .def_readwrite("type", &OptimizerSettings::type)
            .def_readwrite("lr", &OptimizerSettings::lr)
            .def_readwrite("beta1", &OptimizerSettings::beta1)
            .def_readwrite("beta2", &OptimizerSettings::beta2)
            .def_readwrite("eps", &OptimizerSettings::eps)
            .def_readwrite("wd", &OptimizerSettings::wd);

    py::class_<EpochMetrics> metrics(m, "EpochMetrics");
#define X(type, name, init) metrics.def_readonly(#name, &EpochMetrics::name);
#include "epoch_metrics.def"
#undef X

    py::class_<Trainer>(m, "Trainer")
            .def(py::init<std::shared_ptr<Context>, const OptimizerSettings &, int32_t>(), py::arg("context"),
                 py::arg("optimizer"), py::arg("accumulation"), py::call_guard<py::gil_scoped_release>())
            .def("epoch", &epoch, py::arg("tokens"), py::arg("labels"), py::arg("weights"), py::arg("n_train"),
                 py::arg("progress"), py::arg("epoch_callback"), py::arg("duty_cycle"))
            .def("upstream_epoch", &upstream_epoch, py::arg("tokens"), py::arg("labels"), py::arg("n_train"))
            .def(
                    "set_schedule",
                    [](Trainer & t, const py::object & schedule, int64_t horizon) {
                        t.set_schedule(schedule_of(schedule), horizon);
                    },
                    py::arg("schedule"), py::arg("horizon"))
            .def(
                    "micro_batch",
                    [](Trainer & t, const Int32Array & tokens, const Int32Array & labels, int32_t pos0, bool train) {
                        if (tokens.ndim() != 1 || labels.ndim() != 1 || tokens.size() != labels.size() ||
                            tokens.size() > INT32_MAX) {
                            throw std::invalid_argument("tokens and labels must be 1-D arrays of one length");
                        }
                        py::gil_scoped_release release;
                        t.micro_batch(tokens.data(), labels.data(), (int32_t) tokens.size(), pos0, train);
                    },
                    py::arg("tokens"), py::arg("labels"), py::arg("pos0"), py::arg("train"))
            .def("close", &Trainer::close, py::call_guard<py::gil_scoped_release>())
            .def_property_readonly("closed", &Trainer::closed)
            .def_property_readonly("iteration", reading(&Trainer::iteration))
            .def_property_readonly("period_position", reading(&Trainer::period_position))
            .def_property_readonly("poisoned", reading(&Trainer::poisoned))
            .def_property_readonly("stop_requests", reading(&Trainer::stop_requests))
            .def(
                    "moment",
                    [](Trainer & t, const std::string & name, int which) {
                        return read_state(t, name, which == 0 ? 0 : 1);
                    },
                    py::arg("name"), py::arg("which"))
            .def(
                    "gradient_accumulator",
                    [](Trainer & t, const std::string & name) { return read_state(t, name, -1); }, py::arg("name"))
            .def("prepare_state", &Trainer::prepare_state, py::call_guard<py::gil_scoped_release>())
            .def(
                    "set_moment",
                    [](Trainer & t, const std::string & name, int which,
                       py::array_t<float, py::array::c_style> values) {
                        Busy busy(t.held(), CallGuard::Nesting::allowed);
                        ggml_tensor * s = state_of(t, name, which == 0 ? 0 : 1);
                        if (!s) {
                            throw Error(ErrorKind::InvalidState,
                                        "no optimizer moment for '" + name + "' (prepare the state first)");
                        }
                        write_f32(s, values.data(), (size_t) values.size());
                    },
                    py::arg("name"), py::arg("which"), py::arg("values"))
            .def("set_iteration", &Trainer::set_iteration, py::arg("iteration"),
                 py::call_guard<py::gil_scoped_release>());
}

}  // namespace retro::bindings
