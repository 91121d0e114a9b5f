// The training loop. llama.cpp's fork runs one micro-batch per call and reports a status; this
// file owns everything between micro-batches: the progress callback and its cancellation, the
// accumulation period on the way out, the duty-cycle limiter, the metrics and the typed errors.
#include "logging.h"
#include "trainer.h"

#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace retro {
namespace {

struct ResultDeleter {
    void operator()(ggml_opt_result * r) const { ggml_opt_result_free(r); }
};
using ResultPtr = std::unique_ptr<ggml_opt_result, ResultDeleter>;
using Clock     = std::chrono::steady_clock;

// Every weight's bytes: what the seeded defects that undo work (CANCEL-03, FAIL-06) restore.
class ParameterSnapshot {
public:
    void take(const llama_model * model) {
        saved_.clear();
        for (int32_t i = 0; i < llama_model_n_tensors(model); ++i) {
            ggml_tensor * t = llama_model_get_tensor(model, i);
            saved_.emplace_back(t, std::vector<uint8_t>(ggml_nbytes(t)));
            ggml_backend_tensor_get(t, saved_.back().second.data(), 0, ggml_nbytes(t));
        }
    }
    void restore() const {
        for (const auto & [t, bytes] : saved_) {
            ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
        }
    }

private:
    std::vector<std::pair<ggml_tensor *, std::vector<uint8_t>>> saved_;
};

void check_request(const EpochRequest & r, int64_t n_ctx, int64_t n_ubatch) {
    // the Python layer validates and explains; these checks only keep the native loop memory-safe
    if (!r.tokens || (!r.labels && !r.documents) || r.n_windows < 0 || r.n_train < 0 || r.n_train > r.n_windows) {
        throw std::invalid_argument("tokens and labels must be 2-D arrays of one shape");
    }
    if (r.documents && (r.labels || r.k != 1)) {
        throw std::invalid_argument("a packed dataset's targets are its documents' next tokens");
    }
    if (r.k < 1 || r.k > LLAMA_OPT_MAX_TARGETS) {
        throw std::invalid_argument("the targets per token must be in [1, LLAMA_OPT_MAX_TARGETS]");
    }
    if (r.width <= 0 || r.width > n_ctx || r.width % n_ubatch != 0) {
        throw std::invalid_argument("window width must be a multiple of n_ubatch no larger than n_ctx");
    }
    if (!(r.duty_cycle > 0.0 && r.duty_cycle <= 1.0)) {
        throw std::invalid_argument("duty_cycle must be in (0, 1]");
    }
}

// the tokens of a micro-batch with a positive target weight (the others are masked)
int64_t weighted_tokens(const float * weights, int64_t n_tokens, int32_t k) {
    int64_t n = 0;
    for (int64_t i = 0; i < n_tokens; ++i) {
        n += std::any_of(weights + i * k, weights + (i + 1) * k, [](float w) { return w > 0.0f; }) ? 1 : 0;
    }
    return n;
}

// The seeded defects that undo or redo the loop's work (CANCEL-03, CANCEL-05, CANCEL-07, FAIL-06,
// HOST-03.per-window), behind the named points of the loop where each would act: the loop's own
// lines hold none of them. In a release build every point is empty.
class LoopDefects {
public:
    LoopDefects(const Defects & defect, const llama_model * model) : defect_(defect), model_(model) {
        if (defect_(RETRO_DEFECT_FAIL_06)) {
            call_start.take(model_);
        }
    }
    void micro_batch_starting() {
        if (defect_(RETRO_DEFECT_CANCEL_03)) {
            before_micro_batch.take(model_);
        }
    }
    void stopped_after_micro_batch() const {
        if (defect_(RETRO_DEFECT_CANCEL_03)) {
            before_micro_batch.restore();  // seeded defect: the finished micro-batch is undone
        }
    }
    void call_failed() const {
        if (defect_(RETRO_DEFECT_FAIL_06)) {
            call_start.restore();  // seeded defect: a failed call undoes the steps it completed
        }
    }
    // true: the evaluation tail runs after a cancel (CANCEL-05)
    bool evaluate_after_cancel(const ProgressScope & scope, llama_context * lctx) const {
        if (!defect_(RETRO_DEFECT_CANCEL_05) || scope.error) {
            return false;
        }
        llama_opt_clear_stop(lctx);
        return true;
    }
    // each window's sequences planned from the arrays as they are then (HOST-03.per-window)
    void window_starting(RowPlan & plan, const std::function<RowPlan()> & replan) const {
        if (defect_(RETRO_DEFECT_HOST_03_PER_WINDOW) && plan.packed) {
            RowPlan again = replan();
            plan.seq.swap(again.seq);
            plan.pos.swap(again.pos);
            plan.spans.swap(again.spans);
        }
    }
    void leaving_with_debt(double debt_s, EpochMetrics & m) const {
        if (defect_(RETRO_DEFECT_CANCEL_07) && debt_s > 0.0) {
            std::this_thread::sleep_for(std::chrono::duration<double>(debt_s));  // seeded defect: the debt is slept
            m.throttle_s += debt_s;
        }
    }
    void owed(double & debt_s) const {
        if (defect_(RETRO_DEFECT_CANCEL_07_AT_ONCE) && debt_s > 0.0) {
            std::this_thread::sleep_for(std::chrono::duration<double>(debt_s));  // seeded defect: slept at once
            debt_s = 0.0;
        }
    }

private:
    const Defects & defect_;
    const llama_model * model_;
    ParameterSnapshot call_start, before_micro_batch;
};

// Where a micro-batch's inputs and targets come from, chosen once per call: the caller's dense
// target arrays, or its packed documents (each step's targets staged from them).
class StepSource {
public:
    virtual ~StepSource() = default;
    // stages the step's targets; returns its logical tokens (those some target weighs)
    virtual int64_t stage(const PlannedStep & step)                                         = 0;
    virtual int32_t compute(const PlannedStep & step, bool train, ggml_opt_result_t result) = 0;
};

class DenseSource final : public StepSource {
public:
    DenseSource(const EpochRequest & r, llama_context * lctx) : r_(r), lctx_(lctx) {}
    int64_t stage(const PlannedStep & step) override {
        return r_.weights ? weighted_tokens(r_.weights + step.offset * r_.k, step.n_tokens, r_.k) : step.n_tokens;
    }
    int32_t compute(const PlannedStep & step, bool train, ggml_opt_result_t result) override {
        const int64_t off = step.offset;
        return llama_opt_micro_batch_targets(lctx_, r_.tokens + off, r_.labels + off * r_.k,
                                             r_.weights ? r_.weights + off * r_.k : nullptr, r_.k, step.n_tokens,
                                             (llama_pos) (off - step.window * r_.width), train, result);
    }

private:
    const EpochRequest & r_;
    llama_context * lctx_;
};

class PackedSource final : public StepSource {
public:
    // ids and weights: the trainer's staging arrays, which keep their capacity across calls (HOST-05)
    PackedSource(const EpochRequest & r, llama_context * lctx, const RowPlan & plan, std::vector<int32_t> & ids,
                 std::vector<float> & weights, const Defects & defect)
        : r_(r), lctx_(lctx), plan_(plan), ids_(ids), weights_(weights), defect_(defect) {}
    int64_t stage(const PlannedStep & step) override {
        ids_.assign((size_t) step.n_tokens, 0);
        if (defect_(RETRO_DEFECT_HOST_05_STAGING)) {
            ids_ = std::vector<int32_t>((size_t) step.n_tokens, 0);  // seeded defect: a new array every step
        }
        weights_.assign((size_t) step.n_tokens, 0.0f);
        const int64_t row  = step.window * r_.width;
        const int64_t span = plan_.spans[(size_t) step.window];
        int64_t weighted   = 0;
        for (int32_t i = 0; i < step.n_tokens; ++i) {
            const int64_t t = step.offset + i;
            // a token's target is the next token of its document: none for a document's last token
            // (the next one starts another document at position 0) or past the window's active span
            if (t + 1 - row < span && plan_.pos[(size_t) (t + 1)] != 0) {
                ids_[(size_t) i]     = r_.tokens[t + 1];
                weights_[(size_t) i] = r_.weights ? r_.weights[t] : 1.0f;
                weighted += weights_[(size_t) i] > 0.0f;
            }
        }
        return weighted;
    }
    int32_t compute(const PlannedStep & step, bool train, ggml_opt_result_t result) override {
        const int64_t off = step.offset;
        return llama_opt_micro_batch_packed(lctx_, r_.tokens + off, ids_.data(), weights_.data(), 1, step.n_tokens,
                                            plan_.seq.data() + off, plan_.pos.data() + off, train, result);
    }

private:
    const EpochRequest & r_;
    llama_context * lctx_;
    const RowPlan & plan_;
    std::vector<int32_t> & ids_;
    std::vector<float> & weights_;
    const Defects & defect_;
};

}  // namespace

RowPlan Trainer::plan_of(const EpochRequest & r, llama_context * lctx) const {
    const TrainingGeometry geometry = training_geometry(lctx);
    check_request(r, geometry.n_ctx, geometry.n_ubatch);
    PlanInput in;
    in.documents   = r.documents;
    in.n_windows   = r.n_windows;
    in.width       = r.width;
    in.n_train     = r.n_train;
    in.n_ubatch    = geometry.n_ubatch;
    in.n_sequences = llama_n_seq_max(lctx);
    return plan_rows(in, defects_);
}

RowPlan Trainer::plan(const EpochRequest & r) {
    CallGuard call(held());
    defects_ = Defects::current();
    return plan_of(r, ctx());
}

// One epoch call's run, by job: the constructor stages it (checks, plan, step source), micro_batch
// computes, account and notify follow each step, wind_down and finish end the call.
class Trainer::EpochRun {
public:
    EpochRun(const EpochRun &)             = delete;  // its step source points into its plan
    EpochRun & operator=(const EpochRun &) = delete;
    EpochRun(Trainer & t, const EpochRequest & r)
        : t_(t),
          r_(r),
          lctx_(t.ctx()),
          opt_(usable_optimizer(r, lctx_)),
          defect_(t.defects_ = Defects::current()),
          plan_(t.plan_of(r, lctx_)),  // once per call (HOST-03): the loop only iterates it
          hooks_(defect_, t.context_->model->get()),
          guard_(std::make_shared<ProgressScope>(ProgressScope{lctx_, r.progress, nullptr})),
          scope_(guard_.scope()),
          // seeded defect CANCEL-01: the caller's C callback takes the runtime's place
          runtime_reached_(!(defect_(RETRO_DEFECT_CANCEL_01) && r.epoch_callback)) {
        if (plan_.packed) {
            source_ = std::make_unique<PackedSource>(r, lctx_, plan_, t.staged_ids_, t.staged_weights_, defect_);
        } else {
            source_ = std::make_unique<DenseSource>(r, lctx_);
        }
        clear_recent_errors();
        llama_opt_clear_stop(lctx_);
    }

    // the training windows, then the evaluation windows, until a stop or a failure
    void run() {
        for (const bool train : {true, false}) {
            if (failed_status_ != LLAMA_OPT_STATUS_OK) {
                return;
            }
            if (stopped_) {
                if (train || !hooks_.evaluate_after_cancel(scope_, lctx_)) {
                    return;
                }
                stopped_ = false;
            }
            phase(train);
        }
    }

    // what every way out of the call leaves: no stop request, no partial period after a cancel or a
    // before-compute failure, and a fresh sequence for the next decode (training windows leave their
    // tokens in the KV cache)
    void wind_down() {
        hooks_.leaving_with_debt(debt_s_, m_);  // otherwise the debt is dropped: nothing follows it would pace
        if (defect_(RETRO_DEFECT_CANCEL_08) && (stopped_ || scope_.error || failed_status_ != LLAMA_OPT_STATUS_OK)) {
            guard_.keep();  // seeded defect: the scope survives an early exit
        }
        // an incomplete accumulation period must not reach a later call after a cancel (CANCEL-04: a
        // callback returning false, or raising, as Ctrl-C does) or a before-compute failure (FAIL-04).
        // A failed training step was abandoned at its update boundary by llama_opt_micro_batch itself;
        // a failed evaluation step leaves the training period before it, dropped here as a cancel in
        // the evaluation tail drops it. A compute failure poisons the trainer instead.
        // Seeded defects: CANCEL-04.exception (a raising callback not taken for a cancel),
        // CANCEL-04 and FAIL-04.eval-tail (no discard)
        const bool cancelled      = stopped_ && failed_status_ == LLAMA_OPT_STATUS_OK &&
                                    !(scope_.error && defect_(RETRO_DEFECT_CANCEL_04_EXCEPTION));
        const bool before_compute = failed_status_ != LLAMA_OPT_STATUS_OK &&
                                    failed_status_ != LLAMA_OPT_STATUS_COMPUTE &&
                                    failed_status_ != LLAMA_OPT_STATUS_POISONED;
        if ((cancelled && !defect_(RETRO_DEFECT_CANCEL_04)) ||
            (before_compute && !defect_(RETRO_DEFECT_FAIL_04_EVAL_TAIL))) {
            ggml_opt_discard_period(opt_);
        }
        llama_opt_clear_stop(lctx_);
        llama_memory_clear(llama_get_memory(lctx_), true);
        t_.context_->n_past = 0;
    }

    // the metrics of the work that ran, or the error that ended it (ran_before_error, if given,
    // receives those metrics when a callback's exception is re-thrown)
    EpochMetrics finish(EpochMetrics * ran_before_error) {
        if (scope_.error) {
            if (ran_before_error) {
                *ran_before_error = metrics();
            }
            std::rethrow_exception(std::exchange(scope_.error, nullptr));
        }
        if (failed_status_ != LLAMA_OPT_STATUS_OK) {
            hooks_.call_failed();
            throw training_error(failed_status_);
        }
        return metrics();
    }

private:
    // the request's own checks first, then a poisoned trainer's refusal, before anything is planned
    static ggml_opt_context_t usable_optimizer(const EpochRequest & r, llama_context * lctx) {
        const TrainingGeometry geometry = training_geometry(lctx);
        check_request(r, geometry.n_ctx, geometry.n_ubatch);
        ggml_opt_context_t opt = llama_opt_get_context(lctx);
        if (ggml_opt_backend_failed(opt)) {
            throw training_error(LLAMA_OPT_STATUS_POISONED);
        }
        return opt;
    }

    void phase(bool train) {
        const size_t first       = train ? 0 : (size_t) plan_.n_train_steps;
        const size_t end         = train ? (size_t) plan_.n_train_steps : plan_.steps.size();
        const int64_t t_phase_us = ggml_time_us();
        int64_t done             = 0;
        ggml_opt_result_t result = train ? result_train_.get() : result_eval_.get();
        for (size_t s = first; s < end && !stopped_; ++s) {
            if (s == first || plan_.steps[s].window != plan_.steps[s - 1].window) {
                hooks_.window_starting(plan_, [this] { return t_.plan_of(r_, lctx_); });
            }
            micro_batch(plan_.steps[s], train, result, done, plan_.steps_in(train), t_phase_us);
        }
    }

    void micro_batch(const PlannedStep & step, bool train, ggml_opt_result_t result, int64_t & done, int64_t total,
                     int64_t t_phase_us) {
        pay_debt();
        hooks_.micro_batch_starting();
        // a micro-batch that closes a period takes an optimizer step: its scheduled rate is asked
        // for first, so that a schedule that raises stops the call before the step
        const int64_t period_pos = defect_(RETRO_DEFECT_FAIL_03_CALL_COUNT)
                                           ? done % ggml_opt_period(opt_)  // seeded defect: the call's own count
                                           : ggml_opt_period_pos(opt_);
        if (train && t_.schedule_ && period_pos == ggml_opt_period(opt_) - 1 && !t_.schedule_next_step(scope_)) {
            stopped_ = true;
            return;
        }
        const int64_t logical = source_->stage(step);
        t_.context_->threads.apply(lctx_);
        const auto t_mb      = Clock::now();
        const int32_t status = source_->compute(step, train, result);
        if (defect_(RETRO_DEFECT_FAIL_02_EPOCH_CALLBACK) && r_.epoch_callback) {
            // seeded defect: the caller's callback hears of the micro-batch before its status is read
            r_.epoch_callback(train, opt_, nullptr, result, done + 1, total, t_phase_us);
        }
        if (status != LLAMA_OPT_STATUS_OK) {
            failed(status, train, result, done, total, t_phase_us);
            return;
        }
        if (r_.duty_cycle < 1.0) {
            const double compute_s = std::chrono::duration<double>(Clock::now() - t_mb).count();
            debt_s_ += compute_s * (1.0 - r_.duty_cycle) / r_.duty_cycle;
            hooks_.owed(debt_s_);
        }
        account(step, train, logical);
        ++done;
        if (defect_(RETRO_DEFECT_CANCEL_02) && llama_opt_stop_requested(lctx_)) {
            stopped_ = true;  // seeded defect: the request is checked before the callback
            return;
        }
        notify(train, result, done, total, t_phase_us);
        // the stop request is checked after each micro-batch callback, before the next compute
        if (!defect_(RETRO_DEFECT_CANCEL_02) && llama_opt_stop_requested(lctx_)) {
            stopped_ = true;
            hooks_.stopped_after_micro_batch();
        }
    }

    // the duty-cycle limiter's sleep, owed by the last compute, paid before the next one
    void pay_debt() {
        if (debt_s_ > 0.0) {
            std::this_thread::sleep_for(std::chrono::duration<double>(debt_s_));
            m_.throttle_s += debt_s_;
            debt_s_ = 0.0;
        }
    }

    void failed(int32_t status, bool train, ggml_opt_result_t result, int64_t done, int64_t total, int64_t t_phase_us) {
        failed_status_ = status;
        stopped_       = true;
        if (defect_(RETRO_DEFECT_FAIL_02)) {  // seeded defect: the failed step is reported as done
            runtime_epoch_callback(train, opt_, nullptr, result, done + 1, total, t_phase_us);
        }
        if (defect_(RETRO_DEFECT_FAIL_03)) {  // seeded defect: the cursor moves on
            ggml_opt_set_iter(opt_, ggml_opt_get_iter(opt_) + 1);
        }
    }

    void account(const PlannedStep & step, bool train, int64_t logical) {
        const llama_opt_step_times st = llama_opt_last_step_times(lctx_);
        m_.staging_s += 1e-6 * (double) (st.prepare_us + st.inputs_us);
        m_.graph_build_s += 1e-6 * (double) st.graph_build_us;
        m_.backward_alloc_s += 1e-6 * (double) st.backward_alloc_us;
        m_.backward_build_s += 1e-6 * (double) st.backward_build_us;
        m_.alloc_s += 1e-6 * (double) st.alloc_us;
        m_.compute_s += 1e-6 * (double) st.compute_us;
        (train ? m_.train_micro_batches : m_.eval_micro_batches) += 1;
        m_.logical_tokens += logical;
        // padding included: the tokens this micro-batch sent to compute (HOST-04)
        m_.physical_tokens += defect_(RETRO_DEFECT_HOST_04) ? step.active : step.n_tokens;
    }

    void notify(bool train, ggml_opt_result_t result, int64_t done, int64_t total, int64_t t_phase_us) {
        if (r_.epoch_callback && !defect_(RETRO_DEFECT_FAIL_02_EPOCH_CALLBACK)) {
            r_.epoch_callback(train, opt_, nullptr, result, done, total, t_phase_us);
        }
        if (runtime_reached_) {
            runtime_epoch_callback(train, opt_, nullptr, result, done, total, t_phase_us);
        }
    }

    EpochMetrics metrics() {
        EpochMetrics m = m_;
        if (defect_(RETRO_DEFECT_CANCEL_06)) {  // seeded defect: the planned work is reported
            m.train_micro_batches = plan_.n_train_steps;
            m.logical_tokens      = m.physical_tokens =
                    (m.train_micro_batches + m.eval_micro_batches) * training_geometry(lctx_).n_ubatch;
        }
        // complete when every planned micro-batch ran (a stop requested after the last one skips nothing)
        m.epoch_complete =
                m.train_micro_batches == plan_.steps_in(true) && m.eval_micro_batches == plan_.steps_in(false);
        m.optimizer_steps = ggml_opt_get_iter(opt_) - iter0_;
        ggml_opt_result_loss(result_train_.get(), &m.train_loss, &m.train_loss_unc);
        ggml_opt_result_accuracy(result_train_.get(), &m.train_accuracy, nullptr);
        m.has_eval = m.eval_micro_batches > 0;
        if (m.has_eval) {
            ggml_opt_result_loss(result_eval_.get(), &m.eval_loss, &m.eval_loss_unc);
            ggml_opt_result_accuracy(result_eval_.get(), &m.eval_accuracy, nullptr);
        }
        m.elapsed_s = std::chrono::duration<double>(Clock::now() - t0_).count();
        return m;
    }

    Trainer & t_;
    const EpochRequest & r_;
    llama_context * lctx_;
    ggml_opt_context_t opt_;
    const Defects & defect_;
    RowPlan plan_;
    LoopDefects hooks_;
    ScopeGuard guard_;
    ProgressScope & scope_;
    const bool runtime_reached_;
    std::unique_ptr<StepSource> source_;
    ResultPtr result_train_{ggml_opt_result_init()};
    ResultPtr result_eval_{ggml_opt_result_init()};
    const int64_t iter0_        = ggml_opt_get_iter(opt_);
    const Clock::time_point t0_ = Clock::now();
    EpochMetrics m_;
    int32_t failed_status_ = LLAMA_OPT_STATUS_OK;
    bool stopped_          = false;
    double debt_s_         = 0.0;  // sleep owed by the duty-cycle limiter
};

EpochMetrics Trainer::epoch(const EpochRequest & r, EpochMetrics * ran_before_error) {
    const auto call = training_call();
    EpochRun run(*this, r);
    run.run();
    run.wind_down();
    return run.finish(ran_before_error);
}

}  // namespace retro
