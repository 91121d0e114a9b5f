// The native training loop: epochs of micro-batches over llama_opt_micro_batch, with the caller's
// progress callback between micro-batches.
#pragma once

#include "handles.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

namespace retro {

struct OptimizerSettings {
    ggml_opt_optimizer_type type = GGML_OPT_OPTIMIZER_TYPE_ADAMW;
    float lr    = 1e-3f;
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    float eps   = 1e-8f;
    float wd    = 0.0f;
};

struct EpochMetrics {
    double  train_loss = 0.0, train_loss_unc = 0.0, train_accuracy = 0.0;
    double  eval_loss = 0.0, eval_loss_unc = 0.0, eval_accuracy = 0.0;
    bool    has_eval = false;
    int64_t train_micro_batches = 0;
    int64_t eval_micro_batches  = 0;
    int64_t optimizer_steps     = 0;
    int64_t logical_tokens      = 0;
    int64_t physical_tokens     = 0;
    bool    epoch_complete      = false;
    double  elapsed_s           = 0.0;
    double  throttle_s          = 0.0;  // slept by the duty-cycle limiter
};

class Trainer {
public:
    Trainer(std::shared_ptr<Context> context, const OptimizerSettings & opt, int32_t accumulation);
    ~Trainer();

    // tokens/labels: [n_windows, n_ctx] int32; windows [0, n_train) train, the rest evaluate.
    // progress(train, done, total) -> bool is reached through the runtime's epoch callback (upstream
    // ggml_opt_epoch_callback signature) and a thread-local scope; epoch_callback, if not 0, is the
    // address of the caller's own C epoch callback. duty_cycle < 1 throttles compute to that share.
    EpochMetrics epoch(pybind11::array_t<int32_t, pybind11::array::c_style> tokens,
                       pybind11::array_t<int32_t, pybind11::array::c_style> labels,
                       int64_t n_train, pybind11::object progress, uintptr_t epoch_callback, double duty_cycle);

    void close();
    bool closed() const { return !context_; }
    int64_t iteration();        // optimizer iteration cursor (1 + steps applied)
    int32_t period_position();  // micro-batches into the current accumulation period
    bool poisoned();
    void set_lr(float lr) { opt_.lr = lr; }

    // AdamW moments of a parameter tensor (None when there are none yet)
    pybind11::object moment(const std::string & name, int which);
    // the gradient accumulator of a parameter tensor (None when there is none yet)
    pybind11::object gradient_accumulator(const std::string & name);

    // checkpoint restore: create the optimizer state, then write moments and the cursor
    void prepare_state();
    void set_moment(const std::string & name, int which, pybind11::array_t<float, pybind11::array::c_style> values);
    void set_iteration(int64_t iteration);

private:
    llama_context * ctx() const;
    static ggml_opt_optimizer_params optimizer_params(void * self);

    std::shared_ptr<Context> context_;
    OptimizerSettings opt_;
    int32_t accumulation_;
};

void bind_training(pybind11::module_ & m);

// float32 copy of a tensor (any backend) as a numpy array with the tensor's shape, outermost first
pybind11::array_t<float> tensor_to_numpy(const ggml_tensor * t);
// write a float32 array of exactly the tensor's element count into an f32 tensor
void numpy_to_tensor(ggml_tensor * t, const pybind11::array_t<float, pybind11::array::c_style> & values);
const ggml_tensor * find_model_tensor(const llama_model * model, const std::string & name);

}  // namespace retro
