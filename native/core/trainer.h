// A trainer on a context: the optimizer's lifecycle, its state (cursor, period, moments) for
// checkpoints, and the epoch loop (epoch.cpp). No Python here: the binding validates and converts.
// Every call that runs or changes the optimizer takes the context's call guard itself; reads of
// its state are guarded by the caller (the binding), where a callback inside a call may nest.
#pragma once

#include "call_guard.h"
#include "callback_scope.h"
#include "defects.h"
#include "handles.h"
#include "row_plan.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace retro {

struct OptimizerSettings {
    ggml_opt_optimizer_type type = GGML_OPT_OPTIMIZER_TYPE_ADAMW;
    float lr                     = 1e-3f;
    float beta1                  = 0.9f;
    float beta2                  = 0.999f;
    float eps                    = 1e-8f;
    float wd                     = 0.0f;
};

struct EpochMetrics {
#define X(type, name, init) type name = init;
#include "epoch_metrics.def"
#undef X
};

// One epoch call: windows [0, n_train) train, [n_train, n_windows) evaluate. The arrays are
// row-major and borrowed for the call: tokens n_windows x width, labels and weights x k. A packed
// dataset gives documents instead of labels: each token is trained towards the next token of its
// own document (weighted by weights[token], if given), a document's last token towards nothing.
struct EpochRequest {
    const int32_t * tokens    = nullptr;
    const int32_t * labels    = nullptr;  // k target ids per token: [n_windows][width][k]
    const float * weights     = nullptr;  // their weights, same shape; null weighs every target 1
    const int32_t * documents = nullptr;  // packed: each token's document, [n_windows][width]
    int32_t k                 = 1;
    int64_t n_windows         = 0;
    int64_t width             = 0;
    int64_t n_train           = 0;
    std::shared_ptr<const ProgressFn> progress;        // may be empty
    ggml_opt_epoch_callback epoch_callback = nullptr;  // the caller's own C callback, may be null
    double duty_cycle                      = 1.0;
};

// What an epoch allocates in one buffer type for one purpose (llama_opt_preflight's purposes)
struct BufferNeed {
    std::string buffer_type;  // ggml's name of the buffer type; "host" for heap memory
    int32_t purpose = 0;      // enum llama_opt_buffer_purpose
    size_t needed   = 0;      // bytes the largest micro-batch of the epoch needs
    size_t held     = 0;      // bytes held now
};

// bytes ggml's live buffers hold now, per buffer type of every registered device (its own and its
// host buffer type), as ggml counts them where buffers are made and freed: what a step really
// allocated, observed apart from the preflight that predicted it
std::vector<std::pair<std::string, size_t>> live_buffer_bytes();

// schedule(step, horizon) -> the learning rate of optimizer step `step` (0-based) of `horizon`;
// may throw (the exception cancels the call before that step and is re-thrown when it returns)
using ScheduleFn = std::function<float(int64_t step, int64_t horizon)>;

class Trainer {
public:
    Trainer(std::shared_ptr<Context> context, const OptimizerSettings & opt, int32_t accumulation);
    ~Trainer();
    Trainer(const Trainer &)             = delete;
    Trainer & operator=(const Trainer &) = delete;

    // A callback's exception (a progress callback's, or a pending signal the binding raises there)
    // cancels the call and is re-thrown; ran_before_error, if given, then receives the metrics of
    // the work that ran.
    EpochMetrics epoch(const EpochRequest & request, EpochMetrics * ran_before_error = nullptr);
    // the row plan an epoch call on this request would iterate (for checks; epoch builds its own)
    RowPlan plan(const EpochRequest & request);
    // what an epoch call on this request would allocate, measured on the graphs of its
    // micro-batches' geometries (preflight.cpp): nothing is allocated or computed
    std::vector<BufferNeed> preflight(const EpochRequest & request);
    // upstream's own loop (llama_opt_epoch) over the same windows: the oracle of epoch()
    void upstream_epoch(const EpochRequest & request, EpochMetrics & metrics);
    // one micro-batch of the fork's step, nothing around it (the KV cache keeps what the step
    // left): a probe of the state a failed step leaves, before epoch() tidies up on its way out
    void micro_batch(const int32_t * tokens, const int32_t * labels, int32_t n_tokens, int32_t pos0, bool train);

    // a learning-rate schedule replaces the optimizer's fixed rate (empty: the fixed rate)
    void set_schedule(std::shared_ptr<const ScheduleFn> schedule, int64_t horizon);

    void close();
    bool closed() const { return !context_; }
    int64_t iteration();        // optimizer iteration cursor (1 + steps applied)
    int32_t period_position();  // micro-batches into the current accumulation period
    bool poisoned();
    int64_t stop_requests();  // counted by the fork's llama_opt_request_stop
    const std::shared_ptr<Context> & context() const { return context_; }
    // the context, for its call guard (call_guard.h); throws once the trainer is closed
    Context & held() const;
    // the guards a training call (epoch, micro-batch, state preparation, the upstream loop) holds
    // while it runs: its context and its model's weights; seeded defect
    // TX-OWN-04.unguarded-training: none, as if decode's guard had never been extended to training
    TrainingCall training_call();

    // optimizer state of a weight, nullptr where there is none (yet): the gradient accumulator
    // (which == -1) or the AdamW moments (which == 0: first, 1: second)
    ggml_tensor * state_tensor(const std::string & name, int which);

    // checkpoint restore: create the optimizer state, then write moments and the cursor
    void prepare_state();
    void set_iteration(int64_t iteration);
    // a checkpoint written under the context's and the weights' guards at once: every named
    // weight, then each AdamW moment, then the cursor (when given); every name and size is checked
    // before anything is written
    struct TensorWrite {
        std::string name;
        int which;  // -1: a weight of the model; 0/1: an AdamW moment of that weight
        const float * values;
        std::size_t count;
    };
    void restore(const std::vector<TensorWrite> & writes, std::optional<int64_t> iteration);
    // a checkpoint is read or written only at an accumulation boundary of a trainer that is not
    // poisoned (called under the guards of the call that reads or writes it)
    void check_checkpoint_state();

    // the packed-topology cache of the fork (llama_opt_set_topology_cache), its counters, and the
    // walk of its entry's graphs: (sources that are not their own tensors, stale compute addresses)
    void set_topology_cache(bool enabled);
    llama_opt_topology_stats topology_stats();
    std::pair<int64_t, int64_t> topology_walk();

    // the loss head of every later step: fused (sparse targets, no dense label rows) or dense
    void set_head(bool fused);
    bool fused_head() const { return fused_head_; }

    // where a packed step's staged target ids live and the staging's capacity in elements (ids and
    // weights together): for checks of HOST-05, read, never written
    std::pair<uintptr_t, size_t> staged_targets() const {
        return {reinterpret_cast<uintptr_t>(staged_ids_.data()), staged_ids_.capacity() + staged_weights_.capacity()};
    }

private:
    llama_context * ctx() const;
    ggml_opt_context_t opt() const { return llama_opt_get_context(ctx()); }
    static ggml_opt_optimizer_params optimizer_params(void * self);

    // the rate of the step the next micro-batch completes, from the schedule; false if it raised
    bool schedule_next_step(ProgressScope & scope);
    RowPlan plan_of(const EpochRequest & request, llama_context * lctx) const;
    class EpochRun;  // one epoch call, by job (epoch.cpp)

    std::shared_ptr<Context> context_;
    OptimizerSettings opt_;
    int32_t accumulation_;
    std::shared_ptr<const ScheduleFn> schedule_;
    int64_t horizon_ = 0;
    float step_lr_   = 0.0f;  // the scheduled rate ggml's optimizer-parameter callback hands out
    bool fused_head_ = false;
    Defects defects_;  // the snapshot of the call in progress
    // a packed step's target ids and weights, staged in arrays that keep their capacity (HOST-05)
    std::vector<int32_t> staged_ids_;
    std::vector<float> staged_weights_;
};

}  // namespace retro
