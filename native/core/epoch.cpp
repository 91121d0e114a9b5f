// The training loop. llama.cpp's fork runs one micro-batch per call and reports a status; this
// file owns everything between micro-batches: the progress callback and its cancellation, the
// accumulation period on the way out, the duty-cycle limiter, the metrics and the typed errors.
#include "logging.h"
#include "trainer.h"

#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
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

int64_t Trainer::stage_packed_targets(const EpochRequest & r, const RowPlan & plan, const PlannedStep & step) {
    staged_ids_.assign((size_t) step.n_tokens, 0);
    staged_weights_.assign((size_t) step.n_tokens, 0.0f);
    const int64_t row  = step.window * r.width;
    const int64_t span = plan.spans[(size_t) step.window];
    int64_t weighted   = 0;
    for (int32_t i = 0; i < step.n_tokens; ++i) {
        const int64_t t = step.offset + i;
        // a token's target is the next token of its document: none for a document's last token
        // (the next one starts another document at position 0) or past the window's active span
        if (t + 1 - row < span && plan.pos[(size_t) (t + 1)] != 0) {
            staged_ids_[(size_t) i]     = r.tokens[t + 1];
            staged_weights_[(size_t) i] = r.weights ? r.weights[t] : 1.0f;
            weighted += staged_weights_[(size_t) i] > 0.0f;
        }
    }
    return weighted;
}

EpochMetrics Trainer::epoch(const EpochRequest & r, EpochMetrics * ran_before_error) {
    const auto call                 = training_call();
    llama_context * lctx            = ctx();
    ggml_opt_context_t opt          = llama_opt_get_context(lctx);
    const TrainingGeometry geometry = training_geometry(lctx);
    const int64_t n_ctx             = geometry.n_ctx;
    const int64_t n_ubatch          = geometry.n_ubatch;
    check_request(r, n_ctx, n_ubatch);
    if (ggml_opt_backend_failed(opt)) {
        throw training_error(LLAMA_OPT_STATUS_POISONED);
    }
    defects_               = Defects::current();
    const Defects & defect = defects_;
    RowPlan plan           = plan_of(r, lctx);  // once per call (HOST-03): the loop only iterates it

    ResultPtr result_train(ggml_opt_result_init());
    ResultPtr result_eval(ggml_opt_result_init());
    const llama_model * model = context_->model->get();
    ParameterSnapshot call_start, before_micro_batch;  // used only by seeded defects
    if (defect(RETRO_DEFECT_FAIL_06)) {
        call_start.take(model);
    }

    EpochMetrics m;
    const int64_t iter0   = ggml_opt_get_iter(opt);
    int32_t failed_status = LLAMA_OPT_STATUS_OK;
    bool stopped          = false;
    const auto t0         = Clock::now();

    ScopeGuard guard(std::make_shared<ProgressScope>(ProgressScope{lctx, r.progress, nullptr}));
    ProgressScope & scope = guard.scope();
    // seeded defect CANCEL-01: the caller's C callback takes the runtime's place
    const bool runtime_reached = !(defect(RETRO_DEFECT_CANCEL_01) && r.epoch_callback);
    clear_recent_errors();
    llama_opt_clear_stop(lctx);
    double debt_s = 0.0;  // sleep owed by the duty-cycle limiter, paid before the next compute
    for (int phase = 0; phase < 2 && failed_status == LLAMA_OPT_STATUS_OK; ++phase) {
        if (stopped && phase == 1 && defect(RETRO_DEFECT_CANCEL_05) && !scope.error) {
            stopped = false;  // seeded defect: the evaluation tail runs after a cancel
            llama_opt_clear_stop(lctx);
        }
        if (stopped) {
            break;
        }
        const bool train         = phase == 0;
        const size_t s_begin     = train ? 0 : (size_t) plan.n_train_steps;
        const size_t s_end       = train ? (size_t) plan.n_train_steps : plan.steps.size();
        const int64_t total      = plan.steps_in(train);
        const int64_t t_phase_us = ggml_time_us();
        int64_t done             = 0;
        ggml_opt_result_t result = train ? result_train.get() : result_eval.get();
        for (size_t s = s_begin; s < s_end; ++s) {
            const PlannedStep & step = plan.steps[s];
            if (defect(RETRO_DEFECT_HOST_03_PER_WINDOW) && plan.packed &&
                (s == s_begin || step.window != plan.steps[s - 1].window)) {
                // seeded defect: each window's sequences are planned from the arrays as they are then
                RowPlan again = plan_of(r, lctx);
                plan.seq.swap(again.seq);
                plan.pos.swap(again.pos);
                plan.spans.swap(again.spans);
            }
            if (debt_s > 0.0) {
                std::this_thread::sleep_for(std::chrono::duration<double>(debt_s));
                m.throttle_s += debt_s;
                debt_s = 0.0;
            }
            if (defect(RETRO_DEFECT_CANCEL_03)) {
                before_micro_batch.take(model);
            }
            // a micro-batch that closes a period takes an optimizer step: its scheduled rate is
            // asked for first, so that a schedule that raises stops the call before the step
            const int64_t period_pos = defect(RETRO_DEFECT_FAIL_03_CALL_COUNT)
                                               ? done % ggml_opt_period(opt)  // seeded defect: the call's own count
                                               : ggml_opt_period_pos(opt);
            if (train && schedule_ && period_pos == ggml_opt_period(opt) - 1 && !schedule_next_step(scope)) {
                stopped = true;
                break;
            }
            const int64_t off = step.offset;
            // a token counts as logical when some target weighs it; every token is computed
            const int64_t logical =
                    plan.packed
                            ? stage_packed_targets(r, plan, step)
                            : (r.weights ? weighted_tokens(r.weights + off * r.k, step.n_tokens, r.k) : step.n_tokens);
            context_->threads.apply(lctx);
            const auto t_mb = Clock::now();
            const int32_t status =
                    plan.packed
                            ? llama_opt_micro_batch_packed(lctx, r.tokens + off, staged_ids_.data(),
                                                           staged_weights_.data(), 1, step.n_tokens,
                                                           plan.seq.data() + off, plan.pos.data() + off, train, result)
                            : llama_opt_micro_batch_targets(lctx, r.tokens + off, r.labels + off * r.k,
                                                            r.weights ? r.weights + off * r.k : nullptr, r.k,
                                                            step.n_tokens, (llama_pos) (off - step.window * r.width),
                                                            train, result);
            if (defect(RETRO_DEFECT_FAIL_02_EPOCH_CALLBACK) && r.epoch_callback) {
                // seeded defect: the caller's callback hears of the micro-batch before its status is read
                r.epoch_callback(train, opt, nullptr, result, done + 1, total, t_phase_us);
            }
            if (status != LLAMA_OPT_STATUS_OK) {
                failed_status = status;
                stopped       = true;
                if (defect(RETRO_DEFECT_FAIL_02)) {  // seeded defect: the failed step is reported as done
                    runtime_epoch_callback(train, opt, nullptr, result, done + 1, total, t_phase_us);
                }
                if (defect(RETRO_DEFECT_FAIL_03)) {  // seeded defect: the cursor moves on
                    ggml_opt_set_iter(opt, ggml_opt_get_iter(opt) + 1);
                }
                break;
            }
            if (r.duty_cycle < 1.0) {
                const double compute_s = std::chrono::duration<double>(Clock::now() - t_mb).count();
                debt_s += compute_s * (1.0 - r.duty_cycle) / r.duty_cycle;
            }
            const llama_opt_step_times st = llama_opt_last_step_times(lctx);
            m.staging_s += 1e-6 * (double) (st.prepare_us + st.inputs_us);
            m.graph_build_s += 1e-6 * (double) st.graph_build_us;
            m.backward_alloc_s += 1e-6 * (double) st.backward_alloc_us;
            m.backward_build_s += 1e-6 * (double) st.backward_build_us;
            m.alloc_s += 1e-6 * (double) st.alloc_us;
            m.compute_s += 1e-6 * (double) st.compute_us;
            ++done;
            (train ? m.train_micro_batches : m.eval_micro_batches) += 1;
            m.logical_tokens += logical;
            // padding included: the tokens this micro-batch sent to compute (HOST-04)
            m.physical_tokens += defect(RETRO_DEFECT_HOST_04) ? step.active : step.n_tokens;
            if (defect(RETRO_DEFECT_CANCEL_02) && llama_opt_stop_requested(lctx)) {
                stopped = true;  // seeded defect: the request is checked before the callback
                break;
            }
            if (r.epoch_callback && !defect(RETRO_DEFECT_FAIL_02_EPOCH_CALLBACK)) {
                r.epoch_callback(train, opt, nullptr, result, done, total, t_phase_us);
            }
            if (runtime_reached) {
                runtime_epoch_callback(train, opt, nullptr, result, done, total, t_phase_us);
            }
            // the stop request is checked after each micro-batch callback, before the next compute
            if (!defect(RETRO_DEFECT_CANCEL_02) && llama_opt_stop_requested(lctx)) {
                stopped = true;
                if (defect(RETRO_DEFECT_CANCEL_03)) {
                    before_micro_batch.restore();  // seeded defect: the finished micro-batch is undone
                }
                break;
            }
        }
    }
    if (defect(RETRO_DEFECT_CANCEL_07) && debt_s > 0.0) {
        std::this_thread::sleep_for(std::chrono::duration<double>(debt_s));  // seeded defect: the debt is slept
        m.throttle_s += debt_s;
    }
    // otherwise the debt is dropped: nothing follows that it would pace
    if (defect(RETRO_DEFECT_CANCEL_08) && (stopped || scope.error || failed_status != LLAMA_OPT_STATUS_OK)) {
        guard.keep();  // seeded defect: the scope survives an early exit
    }
    if (stopped && failed_status == LLAMA_OPT_STATUS_OK && !defect(RETRO_DEFECT_CANCEL_04)) {
        // cancelled: an incomplete accumulation period must not reach a later call (a failed step
        // was abandoned at its update boundary by llama_opt_micro_batch itself)
        ggml_opt_discard_period(opt);
    }
    llama_opt_clear_stop(lctx);
    // training windows leave their tokens in the KV cache: the next decode starts a fresh sequence
    llama_memory_clear(llama_get_memory(lctx), true);
    context_->n_past = 0;

    // what the metrics say of the work that ran, on the way out
    const auto finish = [&] {
        if (defect(RETRO_DEFECT_CANCEL_06)) {  // seeded defect: the planned work is reported
            m.train_micro_batches = plan.n_train_steps;
            m.logical_tokens = m.physical_tokens = (m.train_micro_batches + m.eval_micro_batches) * n_ubatch;
        }
        // complete when every planned micro-batch ran (a stop requested after the last one skips nothing)
        m.epoch_complete = m.train_micro_batches == plan.steps_in(true) && m.eval_micro_batches == plan.steps_in(false);
        m.optimizer_steps = ggml_opt_get_iter(opt) - iter0;
        ggml_opt_result_loss(result_train.get(), &m.train_loss, &m.train_loss_unc);
        ggml_opt_result_accuracy(result_train.get(), &m.train_accuracy, nullptr);
        m.has_eval = m.eval_micro_batches > 0;
        if (m.has_eval) {
            ggml_opt_result_loss(result_eval.get(), &m.eval_loss, &m.eval_loss_unc);
            ggml_opt_result_accuracy(result_eval.get(), &m.eval_accuracy, nullptr);
        }
        m.elapsed_s = std::chrono::duration<double>(Clock::now() - t0).count();
    };
    if (scope.error) {
        if (ran_before_error) {
            finish();
            *ran_before_error = m;
        }
        std::rethrow_exception(std::exchange(scope.error, nullptr));
    }
    if (failed_status != LLAMA_OPT_STATUS_OK) {
        if (defect(RETRO_DEFECT_FAIL_06)) {
            call_start.restore();  // seeded defect: a failed call undoes the steps it completed
        }
        throw training_error(failed_status);
    }

    finish();
    return m;
}

}  // namespace retro
