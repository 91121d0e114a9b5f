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

// What a dataset hands the native loop for one epoch call (each dataset kind builds its own, in
// Python): its arrays, borrowed for the synchronous call. targets are [n_windows][width] or
// [n_windows][width][k] ids and weights have their shape; a packed dataset has documents
// ([n_windows][width]) instead of targets, and weights, if any, of the tokens' shape.
struct EpochData {
    Int32Array tokens;
    std::optional<Int32Array> targets;
    std::optional<FloatArray> weights;
    std::optional<Int32Array> documents;
};

bool same_rows(const py::array & a, const py::array & b) {
    return a.ndim() >= 2 && b.ndim() >= 2 && a.shape(0) == b.shape(0) && a.shape(1) == b.shape(1);
}

EpochRequest request_of(const EpochData & d, int64_t n_train, double duty_cycle) {
    const Int32Array & tokens = d.tokens;
    if (tokens.ndim() != 2 || d.targets.has_value() == d.documents.has_value()) {
        throw std::invalid_argument("an epoch takes 2-D tokens and either targets or documents");
    }
    EpochRequest r;
    if (d.targets) {
        const Int32Array & labels = *d.targets;
        if ((labels.ndim() != 2 && labels.ndim() != 3) || !same_rows(tokens, labels)) {
            throw std::invalid_argument("tokens and labels must be 2-D arrays of one shape");
        }
        if (d.weights && (d.weights->ndim() != labels.ndim() || d.weights->size() != labels.size())) {
            throw std::invalid_argument("weights must have the shape of the targets");
        }
        const int64_t k = labels.ndim() == 3 ? labels.shape(2) : 1;
        r.labels        = labels.data();
        r.k = (int32_t) std::clamp<int64_t>(k, 0, LLAMA_OPT_MAX_TARGETS + 1);  // the core refuses out of range
    } else {
        if (d.documents->ndim() != 2 || !same_rows(tokens, *d.documents) ||
            (d.weights && (d.weights->ndim() != 2 || !same_rows(tokens, *d.weights)))) {
            throw std::invalid_argument("documents and weights must have the tokens' shape");
        }
        r.documents = d.documents->data();
    }
    r.tokens     = tokens.data();
    r.weights    = d.weights ? d.weights->data() : nullptr;
    r.n_windows  = tokens.shape(0);
    r.width      = tokens.shape(1);
    r.n_train    = n_train;
    r.duty_cycle = duty_cycle;
    return r;
}

// (steps: int64 [n][5] of window, offset, tokens, active tokens, train; seq; pos)
py::tuple plan_to_python(const RowPlan & plan) {
    py::array_t<int64_t> steps({(py::ssize_t) plan.steps.size(), (py::ssize_t) 5});
    auto out = steps.mutable_unchecked<2>();
    for (size_t i = 0; i < plan.steps.size(); ++i) {
        const PlannedStep & s = plan.steps[i];
        out(i, 0)             = s.window;
        out(i, 1)             = s.offset;
        out(i, 2)             = s.n_tokens;
        out(i, 3)             = s.active;
        out(i, 4)             = s.train ? 1 : 0;
    }
    py::array_t<int32_t> seq((py::ssize_t) plan.seq.size(), plan.seq.data());
    py::array_t<int32_t> pos((py::ssize_t) plan.pos.size(), plan.pos.data());
    return py::make_tuple(steps, seq, pos);
}

// A Python object that any thread may hold: it is released under the GIL whichever thread drops
// the last reference (the core keeps callbacks in scopes it may pop without the GIL).
std::shared_ptr<py::object> held_by_native(const py::object & o) {
    return std::shared_ptr<py::object>(new py::object(o), [](py::object * p) {
        py::gil_scoped_acquire acquire;
        delete p;
    });
}

// The core's ProgressFn, called after every micro-batch with the GIL taken: a pending signal
// (Ctrl-C's KeyboardInterrupt) is raised there, at the next micro-batch boundary, and cancels the
// call as a callback's exception does; then the Python progress callback, if any.
std::shared_ptr<const ProgressFn> progress_of(const py::object & progress) {
    auto held = progress.is_none() ? nullptr : held_by_native(progress);
    return std::make_shared<const ProgressFn>([held](bool train, int64_t done, int64_t total) {
        py::gil_scoped_acquire acquire;
        if (PyErr_CheckSignals() != 0) {
            throw py::error_already_set();
        }
        return !held || !(*held)(train, done, total).is(py::bool_(false));
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

EpochMetrics epoch(Trainer & t, const EpochData & data, int64_t n_train, const py::object & progress,
                   uintptr_t epoch_callback, double duty_cycle) {
    EpochRequest r   = request_of(data, n_train, duty_cycle);
    r.progress       = progress_of(progress);
    r.epoch_callback = reinterpret_cast<ggml_opt_epoch_callback>(epoch_callback);
    EpochMetrics ran;
    try {
        WithoutGil release;
        return t.epoch(r, &ran);
    } catch (py::error_already_set & e) {
        // the callback's exception (or the signal's) carries the metrics of the work that ran
        e.value().attr("metrics") = py::cast(ran);
        throw;
    }
}

EpochMetrics upstream_epoch(Trainer & t, const Int32Array & tokens, const Int32Array & labels, int64_t n_train) {
    const EpochRequest r = request_of(EpochData{tokens, labels, std::nullopt, std::nullopt}, n_train, 1.0);
    EpochMetrics m;
    WithoutGil release;
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

    py::class_<EpochData>(m, "EpochData")
            .def(py::init<Int32Array, std::optional<Int32Array>, std::optional<FloatArray>,
                          std::optional<Int32Array>>(),
                 py::arg("tokens"), py::arg("targets"), py::arg("weights"), py::arg("documents"));

    py::class_<Trainer>(m, "Trainer")
            .def(py::init<std::shared_ptr<Context>, const OptimizerSettings &, int32_t>(), py::arg("context"),
                 py::arg("optimizer"), py::arg("accumulation"), py::call_guard<WithoutGil>())
            .def("epoch", &epoch, py::arg("data"), py::arg("n_train"), py::arg("progress"), py::arg("epoch_callback"),
                 py::arg("duty_cycle"))
            .def(
                    "plan",
                    [](Trainer & t, const EpochData & data, int64_t n_train) {
                        const EpochRequest r = request_of(data, n_train, 1.0);
                        RowPlan plan;
                        {
                            WithoutGil release;
                            plan = t.plan(r);
                        }
                        return plan_to_python(plan);
                    },
                    py::arg("data"), py::arg("n_train"))
            // [(buffer type, purpose, bytes needed, bytes held)] of an epoch call on data
            .def(
                    "preflight",
                    [](Trainer & t, const EpochData & data, int64_t n_train) {
                        const EpochRequest r = request_of(data, n_train, 1.0);
                        std::vector<BufferNeed> needs;
                        {
                            WithoutGil release;
                            needs = t.preflight(r);
                        }
                        py::list out;
                        for (const BufferNeed & n : needs) {
                            out.append(py::make_tuple(n.buffer_type, n.purpose, n.needed, n.held));
                        }
                        return out;
                    },
                    py::arg("data"), py::arg("n_train"))
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
                        WithoutGil release;
                        t.micro_batch(tokens.data(), labels.data(), (int32_t) tokens.size(), pos0, train);
                    },
                    py::arg("tokens"), py::arg("labels"), py::arg("pos0"), py::arg("train"))
            .def("close", &Trainer::close, py::call_guard<WithoutGil>())
            .def_property_readonly("closed", &Trainer::closed)
            .def_property_readonly("iteration", reading(&Trainer::iteration))
            .def_property_readonly("period_position", reading(&Trainer::period_position))
            .def_property_readonly("poisoned", reading(&Trainer::poisoned))
            .def_property_readonly("staged_targets",
                                   [](Trainer & t) {
                                       // not while an epoch on another thread may grow the staging
                                       Busy busy(t.held(), CallGuard::Nesting::allowed);
                                       return t.staged_targets();
                                   })
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
            .def("prepare_state", &Trainer::prepare_state, py::call_guard<WithoutGil>())
            .def("set_head", &Trainer::set_head, py::arg("fused"), py::call_guard<WithoutGil>())
            .def("set_topology_cache", &Trainer::set_topology_cache, py::arg("enabled"), py::call_guard<WithoutGil>())
            // the fork's counters of the topology cache: hits, misses (by key part), allocations,
            // invalidations (by event), the last reason, whether it is on and holds an entry
            .def_property_readonly("topology_stats",
                                   [](Trainer & t) {
                                       const llama_opt_topology_stats s = t.topology_stats();
                                       py::dict d;
                                       d["hits"]          = s.hits;
                                       d["misses"]        = s.misses;
                                       d["allocations"]   = s.allocations;
                                       d["invalidations"] = s.invalidations;
                                       d["by_reason"] = std::vector<int64_t>(s.by_reason,
                                                                             s.by_reason + LLAMA_OPT_TOPOLOGY_REASONS);
                                       d["last_reason"] = s.last_reason;
                                       d["enabled"]     = s.enabled;
                                       d["has_entry"]   = s.has_entry;
                                       return d;
                                   })
            .def_property_readonly("topology_walk", &Trainer::topology_walk)
            .def_property_readonly("fused_head", &Trainer::fused_head)
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
            .def("set_iteration", &Trainer::set_iteration, py::arg("iteration"), py::call_guard<WithoutGil>())
            .def(
                    "restore",
                    [](Trainer & t,
                       const std::vector<std::tuple<std::string, int, py::array_t<float, py::array::c_style>>> & writes,
                       std::optional<int64_t> iteration) {
                        // which: -1 a weight, 0/1 an AdamW moment; the arrays live in `writes` for the call
                        std::vector<Trainer::TensorWrite> native;
                        native.reserve(writes.size());
                        for (const auto & [name, which, values] : writes) {
                            native.push_back({name, which < 0 ? -1 : (which == 0 ? 0 : 1), values.data(),
                                              (size_t) values.size()});
                        }
                        WithoutGil release;
                        t.restore(native, iteration);
                    },
                    py::arg("writes"), py::arg("iteration"))
            .def("snapshot", [](Trainer & t) {
                // the weights and their AdamW moments of one step, at a boundary: the weights' guard,
                // then the context's (call_guard.h), waited for without the GIL
                std::optional<TrainingCall> call;
                {
                    WithoutGil release;
                    call.emplace(&t.held(), GateGuard::Nesting::allowed);
                }
                t.check_checkpoint_state();
                llama_model * model = t.held().model->get();
                py::dict params, moments;
                for (int32_t i = 0; i < llama_model_n_tensors(model); ++i) {
                    const ggml_tensor * w  = llama_model_get_tensor(model, i);
                    const std::string name = ggml_get_name(w);
                    params[py::str(name)]  = tensor_to_numpy(w);
                    const ggml_tensor * m  = t.state_tensor(name, 0);
                    const ggml_tensor * v  = t.state_tensor(name, 1);
                    if (m && v) {
                        moments[py::str(name)] = py::make_tuple(tensor_to_numpy(m), tensor_to_numpy(v));
                    }
                }
                return py::make_tuple(params, moments, t.iteration());
            });
}

}  // namespace retro::bindings
