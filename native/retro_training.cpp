// The training loop of the reference binding. llama.cpp's fork runs one micro-batch per call and
// reports a status; this file owns everything between micro-batches: the progress callback and
// its cancellation, the accumulation period on the way out, the metrics and the typed errors.
#include "retro_training.h"

#include "ggml-backend.h"
#include "logging.h"
#include "retro-hooks.h"

#include <chrono>
#include <cstring>
#include <algorithm>
#include <optional>
#include <thread>

namespace py = pybind11;

namespace retro {
namespace {

struct ResultDeleter {
    void operator()(ggml_opt_result * r) const { ggml_opt_result_free(r); }
};
using ResultPtr = std::unique_ptr<ggml_opt_result, ResultDeleter>;

ErrorKind kind_of_status(int32_t status) {
    if (retro_mutant_on("FAIL-01")) {
        return ErrorKind::InvalidState;  // seeded defect: every failure reads as one generic class
    }
    switch (status) {
        case LLAMA_OPT_STATUS_BATCH_INIT:     return ErrorKind::BatchInit;
        case LLAMA_OPT_STATUS_MEMORY_INIT:    return ErrorKind::MemoryInit;
        case LLAMA_OPT_STATUS_OUTPUT_RESERVE: return ErrorKind::OutputReserve;
        case LLAMA_OPT_STATUS_GRAPH_BUILD:    return ErrorKind::GraphBuild;
        case LLAMA_OPT_STATUS_ALLOC:          return ErrorKind::Allocation;
        case LLAMA_OPT_STATUS_COMPUTE:        return ErrorKind::Compute;
        case LLAMA_OPT_STATUS_POISONED:       return ErrorKind::Poisoned;
        default:                              return ErrorKind::InvalidState;
    }
}

const char * status_text(int32_t status) {
    switch (status) {
        case LLAMA_OPT_STATUS_INVALID:        return "the micro-batch was rejected as invalid";
        case LLAMA_OPT_STATUS_BATCH_INIT:     return "batch initialization failed";
        case LLAMA_OPT_STATUS_MEMORY_INIT:    return "memory initialization failed";
        case LLAMA_OPT_STATUS_OUTPUT_RESERVE: return "output buffer reservation failed";
        case LLAMA_OPT_STATUS_GRAPH_BUILD:    return "graph build failed";
        case LLAMA_OPT_STATUS_ALLOC:          return "graph allocation failed";
        case LLAMA_OPT_STATUS_COMPUTE:        return "backend compute failed; the trainer refuses every later call";
        case LLAMA_OPT_STATUS_POISONED:       return "an earlier backend compute failed; recreate the trainer and restore a checkpoint";
        default:                              return "unknown training status";
    }
}

}  // namespace

const ggml_tensor * find_model_tensor(const llama_model * model, const std::string & name) {
    const int32_t n = llama_model_n_tensors(model);
    for (int32_t i = 0; i < n; ++i) {
        const ggml_tensor * t = llama_model_get_tensor(model, i);
        if (t && name == ggml_get_name(t)) {
            return t;
        }
    }
    throw py::key_error("no tensor named '" + name + "' in the model");
}

py::array_t<float> tensor_to_numpy(const ggml_tensor * t) {
    std::vector<py::ssize_t> shape;
    for (int d = ggml_n_dims(t) - 1; d >= 0; --d) {
        shape.push_back(t->ne[d]);
    }
    py::array_t<float> out(shape);
    const int64_t n = ggml_nelements(t);
    if (t->type == GGML_TYPE_F32) {
        if (retro_mutant_on("BASE-03") && n > 1) {
            // seeded defect: a partial copy that misses the last element
            ggml_backend_tensor_get(t, out.mutable_data(), 0, ggml_nbytes(t) - sizeof(float));
            out.mutable_data()[n - 1] = 0.0f;
            return out;
        }
        ggml_backend_tensor_get(t, out.mutable_data(), 0, ggml_nbytes(t));
        return out;
    }
    const auto * traits = ggml_get_type_traits(t->type);
    if (!traits->to_float || !ggml_is_contiguous(t)) {
        throw py::type_error(std::string("cannot read a tensor of type ") + ggml_type_name(t->type) + " as float32");
    }
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    traits->to_float(raw.data(), out.mutable_data(), n);
    return out;
}

void numpy_to_tensor(ggml_tensor * t, const py::array_t<float, py::array::c_style> & values) {
    if (t->type != GGML_TYPE_F32 || (int64_t) values.size() != ggml_nelements(t)) {
        throw std::invalid_argument(std::string("cannot write ") + std::to_string(values.size()) +
                                    " float32 values into tensor '" + ggml_get_name(t) + "'");
    }
    ggml_backend_tensor_set(t, values.data(), 0, ggml_nbytes(t));
}

Trainer::Trainer(std::shared_ptr<Context> context, const OptimizerSettings & opt, int32_t accumulation)
    : context_(std::move(context)), opt_(opt), accumulation_(accumulation) {
    llama_context * lctx = context_->get();
    if (context_->has_trainer) {
        throw Error(ErrorKind::InvalidState, "the context already has a trainer; close that one first");
    }
    if (!context_->model->trainable) {
        throw Error(ErrorKind::InvalidState, "the model was not loaded with trainable=True");
    }
    // llama_opt_init asserts these; the Python layer checks them first, this keeps asserts unreachable
    const uint32_t n_ctx = llama_n_ctx(lctx);
    const uint32_t n_batch = std::min(llama_n_batch(lctx), n_ctx);
    const uint32_t n_ubatch = std::min(llama_n_ubatch(lctx), n_batch);
    if (accumulation < 1 || n_ctx % n_batch != 0 || n_batch % n_ubatch != 0) {
        throw std::invalid_argument("training needs n_ctx % n_batch == 0, n_batch % n_ubatch == 0, accumulation >= 1");
    }
    llama_opt_params params{};
    params.n_ctx_train     = 0;
    params.param_filter    = llama_opt_param_filter_all;
    params.param_filter_ud = nullptr;
    params.get_opt_pars    = &Trainer::optimizer_params;
    params.get_opt_pars_ud = this;
    params.optimizer_type  = opt_.type;
    params.opt_period      = accumulation;
    {
        py::gil_scoped_release release;
        llama_opt_init(lctx, context_->model->get(), params);
    }
    context_->has_trainer = true;
}

Trainer::~Trainer() {
    close();
}

void Trainer::close() {
    if (!context_) {
        return;
    }
    if (context_->ctx) {
        llama_opt_free(context_->ctx);
    }
    context_->has_trainer = false;
    context_.reset();
}

llama_context * Trainer::ctx() const {
    if (!context_) {
        throw Error(ErrorKind::InvalidState, "the trainer is closed");
    }
    return context_->get();
}

ggml_opt_optimizer_params Trainer::optimizer_params(void * self) {
    const auto * t = static_cast<const Trainer *>(self);
    ggml_opt_optimizer_params p = ggml_opt_get_default_optimizer_params(nullptr);
    p.adamw.alpha = t->opt_.lr;
    p.adamw.beta1 = t->opt_.beta1;
    p.adamw.beta2 = t->opt_.beta2;
    p.adamw.eps   = t->opt_.eps;
    p.adamw.wd    = t->opt_.wd;
    p.sgd.alpha   = t->opt_.lr;
    p.sgd.wd      = t->opt_.wd;
    if (retro_mutant_on("BASE-02")) {
        // seeded defect: the step size depends on hidden process-wide state
        static int64_t calls = 0;
        const float drift = 1.0f + 1e-2f * (float) (++calls % 7);
        p.adamw.alpha *= drift;
        p.sgd.alpha   *= drift;
    }
    return p;
}

int64_t Trainer::iteration() {
    return ggml_opt_get_iter(llama_opt_get_context(ctx()));
}

int32_t Trainer::period_position() {
    return ggml_opt_period_pos(llama_opt_get_context(ctx()));
}

bool Trainer::poisoned() {
    return ggml_opt_backend_failed(llama_opt_get_context(ctx()));
}

py::object Trainer::gradient_accumulator(const std::string & name) {
    llama_context * lctx = ctx();
    const ggml_tensor * t = find_model_tensor(context_->model->get(), name);
    const ggml_tensor * acc = ggml_opt_param_grad_acc(llama_opt_get_context(lctx), t);
    if (!acc) {
        return py::none();
    }
    return tensor_to_numpy(acc);
}

void Trainer::prepare_state() {
    llama_context * lctx = ctx();
    clear_recent_errors();
    int32_t status;
    {
        py::gil_scoped_release release;
        status = llama_opt_prepare_state(lctx);
    }
    if (status != LLAMA_OPT_STATUS_OK) {
        throw Error(kind_of_status(status), with_diagnostic(status_text(status)));
    }
}

void Trainer::set_moment(const std::string & name, int which, py::array_t<float, py::array::c_style> values) {
    llama_context * lctx = ctx();
    const ggml_tensor * t = find_model_tensor(context_->model->get(), name);
    ggml_tensor * m = ggml_opt_param_moment(llama_opt_get_context(lctx), t, which);
    if (!m) {
        throw Error(ErrorKind::InvalidState, "no optimizer moment for '" + name + "' (prepare the state first)");
    }
    numpy_to_tensor(m, values);
}

void Trainer::set_iteration(int64_t iteration) {
    if (iteration < 1) {
        throw std::invalid_argument("the optimizer iteration starts at 1");
    }
    ggml_opt_set_iter(llama_opt_get_context(ctx()), iteration);
}

py::object Trainer::moment(const std::string & name, int which) {
    llama_context * lctx = ctx();
    const ggml_tensor * t = find_model_tensor(context_->model->get(), name);
    const ggml_tensor * m = ggml_opt_param_moment(llama_opt_get_context(lctx), t, which);
    if (!m) {
        return py::none();
    }
    return tensor_to_numpy(m);
}

namespace {

// One epoch call's callback scope. The runtime's epoch callback has upstream's void signature, so
// it finds the caller's progress callback here: a thread-local stack, one entry per (possibly
// nested) epoch call, popped on every exit (CANCEL-08).
struct ProgressScope {
    std::shared_ptr<Context> context;
    py::object progress;                                // None: no progress callback
    std::optional<py::error_already_set> error;         // what progress raised, re-raised on return
};

// leaked on purpose: entries hold Python objects, which must not be released at thread exit
thread_local std::vector<std::shared_ptr<ProgressScope>> * t_scopes = nullptr;

std::vector<std::shared_ptr<ProgressScope>> & scopes() {
    if (!t_scopes) {
        t_scopes = new std::vector<std::shared_ptr<ProgressScope>>();
    }
    return *t_scopes;
}

void request_stop(ProgressScope & scope) {
    if (scope.context && scope.context->ctx) {
        retro_count("stop_request");
        llama_opt_request_stop(scope.context->ctx);
    }
}

// The runtime's epoch callback (upstream ggml_opt_epoch_callback): calls the progress callback of
// the innermost scope; False, or an exception, requests the stop.
void runtime_epoch_callback(bool train, ggml_opt_context_t, ggml_opt_dataset_t, ggml_opt_result_t,
                            int64_t ibatch, int64_t ibatch_max, int64_t) {
    if (!t_scopes || t_scopes->empty()) {
        return;
    }
    ProgressScope & scope = *t_scopes->back();
    py::gil_scoped_acquire acquire;
    if (scope.progress.is_none()) {
        return;
    }
    try {
        py::object r = scope.progress(train, ibatch, ibatch_max);
        if (r.is(py::bool_(false))) {
            request_stop(scope);
            if (retro_mutant_on("CANCEL-01")) {
                request_stop(scope);  // seeded defect: the stop is requested twice
            }
        }
    } catch (py::error_already_set & err) {
        if (!scope.error) {
            scope.error.emplace(std::move(err));
        }
        request_stop(scope);
    }
}

}  // namespace

EpochMetrics Trainer::epoch(py::array_t<int32_t, py::array::c_style> tokens,
                            py::array_t<int32_t, py::array::c_style> labels,
                            int64_t n_train, py::object progress, uintptr_t epoch_callback, double duty_cycle) {
    llama_context * lctx = ctx();
    ggml_opt_context_t opt = llama_opt_get_context(lctx);
    const int64_t n_ctx    = llama_n_ctx(lctx);
    const int64_t n_ubatch = std::min<int64_t>(llama_n_ubatch(lctx), std::min<int64_t>(llama_n_batch(lctx), n_ctx));

    // the Python layer validates and explains; these checks only keep the native loop memory-safe
    if (tokens.ndim() != 2 || labels.ndim() != 2 || tokens.shape(0) != labels.shape(0) ||
            tokens.shape(1) != labels.shape(1)) {
        throw std::invalid_argument("tokens and labels must be 2-D arrays of one shape");
    }
    const int64_t n_windows = tokens.shape(0);
    const int64_t width     = tokens.shape(1);
    if (width <= 0 || width > n_ctx || width % n_ubatch != 0 || n_train < 0 || n_train > n_windows) {
        throw std::invalid_argument("window width must be a multiple of n_ubatch no larger than n_ctx");
    }
    if (!(duty_cycle > 0.0 && duty_cycle <= 1.0)) {
        throw std::invalid_argument("duty_cycle must be in (0, 1]");
    }
    if (ggml_opt_backend_failed(opt)) {
        throw Error(ErrorKind::Poisoned, status_text(LLAMA_OPT_STATUS_POISONED));
    }

    const int32_t * tok = tokens.data();
    const int32_t * lab = labels.data();
    const int64_t per_window = width / n_ubatch;
    const auto caller_callback = reinterpret_cast<ggml_opt_epoch_callback>(epoch_callback);
    ResultPtr result_train(ggml_opt_result_init());
    ResultPtr result_eval(ggml_opt_result_init());

    EpochMetrics m;
    const int64_t iter0 = ggml_opt_get_iter(opt);
    int32_t failed_status = LLAMA_OPT_STATUS_OK;
    bool stopped = false;
    const auto t0 = std::chrono::steady_clock::now();

    // seeded defects (conformance/mutants.toml): all off outside a conformance run
    const bool late_stop_check = retro_mutant_on("CANCEL-02") || retro_mutant_on("CANCEL-03");
    const bool keep_partial    = retro_mutant_on("CANCEL-04");
    const bool eval_after_stop = retro_mutant_on("CANCEL-05");
    const bool count_planned   = retro_mutant_on("CANCEL-06");
    const bool sleep_on_exit   = retro_mutant_on("CANCEL-07");
    const bool keep_scope      = retro_mutant_on("CANCEL-08");
    const bool report_failed   = retro_mutant_on("FAIL-02");
    const bool advance_failed  = retro_mutant_on("FAIL-03");
    // seeded defect FAIL-06: a failed call rolls back the steps it completed
    std::vector<std::pair<ggml_tensor *, std::vector<uint8_t>>> rollback;
    if (retro_mutant_on("FAIL-06")) {
        const llama_model * model = context_->model->get();
        for (int32_t i = 0; i < llama_model_n_tensors(model); ++i) {
            ggml_tensor * t = llama_model_get_tensor(model, i);
            rollback.emplace_back(t, std::vector<uint8_t>(ggml_nbytes(t)));
            ggml_backend_tensor_get(t, rollback.back().second.data(), 0, ggml_nbytes(t));
        }
    }

    auto scope = std::make_shared<ProgressScope>(ProgressScope{context_, progress, std::nullopt});
    scopes().push_back(scope);
    clear_recent_errors();
    llama_opt_clear_stop(lctx);
    double debt_s = 0.0;  // sleep owed by the duty-cycle limiter, paid before the next compute
    {
        py::gil_scoped_release release;
        for (int phase = 0; phase < 2 && failed_status == LLAMA_OPT_STATUS_OK; ++phase) {
            if (stopped && phase == 1 && eval_after_stop && !scope->error) {
                stopped = false;
                llama_opt_clear_stop(lctx);
            }
            if (stopped) {
                break;
            }
            const bool train = phase == 0;
            const int64_t w_begin = train ? 0 : n_train;
            const int64_t w_end   = train ? n_train : n_windows;
            const int64_t total   = (w_end - w_begin) * per_window;
            const int64_t t_phase_us = ggml_time_us();
            int64_t done = 0;
            ggml_opt_result_t result = train ? result_train.get() : result_eval.get();
            for (int64_t w = w_begin; w < w_end && !stopped; ++w) {
                for (int64_t k = 0; k < per_window; ++k) {
                    if (debt_s > 0.0) {
                        retro_count("limiter_sleep");
                        std::this_thread::sleep_for(std::chrono::duration<double>(debt_s));
                        m.throttle_s += debt_s;
                        debt_s = 0.0;
                    }
                    const int64_t off = w * width + k * n_ubatch;
                    const auto t_mb = std::chrono::steady_clock::now();
                    const int32_t status = llama_opt_micro_batch(lctx, tok + off, lab + off, (int32_t) n_ubatch,
                                                                 (llama_pos) (k * n_ubatch), train, result);
                    if (status != LLAMA_OPT_STATUS_OK) {
                        failed_status = status;
                        stopped = true;
                        if (report_failed) {  // seeded defect: the failed step is reported as done
                            runtime_epoch_callback(train, opt, nullptr, result, done + 1, total, t_phase_us);
                        }
                        if (advance_failed) {
                            ggml_opt_set_iter(opt, ggml_opt_get_iter(opt) + 1);  // seeded defect: the cursor moves on
                        }
                        break;
                    }
                    if (duty_cycle < 1.0) {
                        const double compute_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_mb).count();
                        debt_s += compute_s * (1.0 - duty_cycle) / duty_cycle;
                    }
                    ++done;
                    (train ? m.train_micro_batches : m.eval_micro_batches) += 1;
                    // every label of a token window is real: no padding is sent to compute
                    m.logical_tokens  += n_ubatch;
                    m.physical_tokens += n_ubatch;
                    if (late_stop_check && llama_opt_stop_requested(lctx)) {
                        stopped = true;  // seeded defect: a request seen only after one more compute
                        break;
                    }
                    if (caller_callback) {
                        caller_callback(train, opt, nullptr, result, done, total, t_phase_us);
                    }
                    runtime_epoch_callback(train, opt, nullptr, result, done, total, t_phase_us);
                    // the stop request is checked after each micro-batch callback, before the next compute
                    if (!late_stop_check && llama_opt_stop_requested(lctx)) {
                        stopped = true;
                        break;
                    }
                }
            }
        }
        if (sleep_on_exit && debt_s > 0.0) {
            retro_count("limiter_sleep");  // seeded defect: the debt is slept on the way out
            std::this_thread::sleep_for(std::chrono::duration<double>(debt_s));
            m.throttle_s += debt_s;
        }
        // otherwise the debt is dropped: nothing follows that it would pace
    }
    const bool clean_exit = !stopped && !scope->error && failed_status == LLAMA_OPT_STATUS_OK;
    if (!keep_scope || clean_exit) {  // seeded defect CANCEL-08: the scope survives an early exit
        auto & stack = scopes();
        stack.erase(std::find(stack.begin(), stack.end(), scope));
    }
    if (stopped && failed_status == LLAMA_OPT_STATUS_OK && !keep_partial) {
        // cancelled: an incomplete accumulation period must not reach a later call (a failed step
        // was abandoned at its update boundary by llama_opt_micro_batch itself)
        ggml_opt_discard_period(opt);
    }
    llama_opt_clear_stop(lctx);
    // training windows leave their tokens in the KV cache: the next decode starts a fresh sequence
    llama_memory_clear(llama_get_memory(lctx), true);
    context_->n_past = 0;

    if (scope->error) {
        py::error_already_set err = std::move(*scope->error);
        scope->error.reset();
        throw err;
    }
    if (failed_status != LLAMA_OPT_STATUS_OK) {
        for (auto & [t, bytes] : rollback) {
            ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
        }
        throw Error(kind_of_status(failed_status), with_diagnostic(status_text(failed_status)));
    }

    if (count_planned) {
        m.train_micro_batches = n_train * per_window;
        m.logical_tokens = m.physical_tokens = (m.train_micro_batches + m.eval_micro_batches) * n_ubatch;
    }
    // complete when every planned micro-batch ran (a stop requested after the last one skips nothing)
    m.epoch_complete  = m.train_micro_batches == n_train * per_window &&
                        m.eval_micro_batches == (n_windows - n_train) * per_window;
    m.optimizer_steps = ggml_opt_get_iter(opt) - iter0;
    ggml_opt_result_loss(result_train.get(), &m.train_loss, &m.train_loss_unc);
    ggml_opt_result_accuracy(result_train.get(), &m.train_accuracy, nullptr);
    m.has_eval = m.eval_micro_batches > 0;
    if (m.has_eval) {
        ggml_opt_result_loss(result_eval.get(), &m.eval_loss, &m.eval_loss_unc);
        ggml_opt_result_accuracy(result_eval.get(), &m.eval_accuracy, nullptr);
    }
    m.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return m;
}

void bind_training(py::module_ & m) {
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

    py::class_<EpochMetrics>(m, "EpochMetrics")
        .def_readonly("train_loss", &EpochMetrics::train_loss)
        .def_readonly("train_loss_unc", &EpochMetrics::train_loss_unc)
        .def_readonly("train_accuracy", &EpochMetrics::train_accuracy)
        .def_readonly("eval_loss", &EpochMetrics::eval_loss)
        .def_readonly("eval_loss_unc", &EpochMetrics::eval_loss_unc)
        .def_readonly("eval_accuracy", &EpochMetrics::eval_accuracy)
        .def_readonly("has_eval", &EpochMetrics::has_eval)
        .def_readonly("train_micro_batches", &EpochMetrics::train_micro_batches)
        .def_readonly("eval_micro_batches", &EpochMetrics::eval_micro_batches)
        .def_readonly("optimizer_steps", &EpochMetrics::optimizer_steps)
        .def_readonly("logical_tokens", &EpochMetrics::logical_tokens)
        .def_readonly("physical_tokens", &EpochMetrics::physical_tokens)
        .def_readonly("epoch_complete", &EpochMetrics::epoch_complete)
        .def_readonly("elapsed_s", &EpochMetrics::elapsed_s)
        .def_readonly("throttle_s", &EpochMetrics::throttle_s);

    py::class_<Trainer>(m, "Trainer")
        .def(py::init<std::shared_ptr<Context>, const OptimizerSettings &, int32_t>(),
             py::arg("context"), py::arg("optimizer"), py::arg("accumulation"))
        .def("epoch", &Trainer::epoch, py::arg("tokens"), py::arg("labels"), py::arg("n_train"), py::arg("progress"),
             py::arg("epoch_callback"), py::arg("duty_cycle"))
        .def("close", &Trainer::close)
        .def_property_readonly("closed", &Trainer::closed)
        .def_property_readonly("iteration", &Trainer::iteration)
        .def_property_readonly("period_position", &Trainer::period_position)
        .def_property_readonly("poisoned", &Trainer::poisoned)
        .def("set_lr", &Trainer::set_lr)
        .def("moment", &Trainer::moment, py::arg("name"), py::arg("which"))
        .def("gradient_accumulator", &Trainer::gradient_accumulator, py::arg("name"))
        .def("prepare_state", &Trainer::prepare_state)
        .def("set_moment", &Trainer::set_moment, py::arg("name"), py::arg("which"), py::arg("values"))
        .def("set_iteration", &Trainer::set_iteration, py::arg("iteration"));
}

}  // namespace retro
