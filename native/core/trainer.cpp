#include "trainer.h"
#include "decoding.h"

#include "logging.h"
#include "tensor_io.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace retro {

Trainer::Trainer(std::shared_ptr<Context> context, const OptimizerSettings & opt, int32_t accumulation)
    : context_(std::move(context)), opt_(opt), accumulation_(accumulation) {
    CallGuard call(*context_);
    llama_context * lctx = context_->get();
    if (context_->has_trainer) {
        throw Error(ErrorKind::InvalidState, "the context already has a trainer; close that one first");
    }
    if (!context_->model->trainable) {
        throw Error(ErrorKind::InvalidState, "the model was not loaded with trainable=True");
    }
    // llama_opt_init asserts these; the Python layer checks them first, this keeps asserts unreachable
    const TrainingGeometry g = training_geometry(lctx);
    if (accumulation < 1 || g.n_ctx % g.n_batch != 0 || g.n_batch % g.n_ubatch != 0) {
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
    llama_opt_init(lctx, context_->model->get(), params);
    context_->has_trainer = true;
}

Trainer::~Trainer() {
    try {
        close();
    } catch (const std::exception &) {
        // refused (freed by the thread inside a call on its context): llama_free frees the
        // optimization context with the context itself
    }
}

void Trainer::close() {
    if (!context_) {
        return;
    }
    // the trainer may hold the last reference: the context must outlive the guard on it
    const std::shared_ptr<Context> context = context_;
    CallGuard call(*context);
    if (context->ctx) {
        llama_opt_free(context->ctx);
    }
    context->has_trainer = false;
    context_.reset();
}

Context & Trainer::held() const {
    if (!context_) {
        throw Error(ErrorKind::InvalidState, "the trainer is closed");
    }
    return *context_;
}

TrainingCall Trainer::training_call() {
    if (retro_defect_on(RETRO_DEFECT_TX_OWN_04_UNGUARDED_TRAINING)) {
        held();  // a closed trainer is still refused
        return TrainingCall(nullptr);
    }
    return TrainingCall(&held());
}

llama_context * Trainer::ctx() const {
    if (!context_) {
        throw Error(ErrorKind::InvalidState, "the trainer is closed");
    }
    return context_->get();
}

ggml_opt_optimizer_params Trainer::optimizer_params(void * self) {
    const auto * t              = static_cast<const Trainer *>(self);
    ggml_opt_optimizer_params p = ggml_opt_get_default_optimizer_params(nullptr);
    const float lr              = t->schedule_ ? t->step_lr_ : t->opt_.lr;  // the scheduled rate, if any
    p.adamw.alpha               = lr;
    p.adamw.beta1               = t->opt_.beta1;
    p.adamw.beta2               = t->opt_.beta2;
    p.adamw.eps                 = t->opt_.eps;
    p.adamw.wd                  = t->opt_.wd;
    p.sgd.alpha                 = lr;
    p.sgd.wd                    = t->opt_.wd;
    if (t->defects_(RETRO_DEFECT_BASE_02)) {
        // seeded defect: the step size depends on hidden process-wide state
        static int64_t calls = 0;
        const float drift    = 1.0f + 1e-2f * (float) (++calls % 7);
        p.adamw.alpha *= drift;
        p.sgd.alpha *= drift;
    }
    return p;
}

void Trainer::set_schedule(std::shared_ptr<const ScheduleFn> schedule, int64_t horizon) {
    if (schedule && horizon < 1) {
        throw std::invalid_argument("a schedule needs a horizon of at least one step");
    }
    schedule_ = std::move(schedule);
    horizon_  = horizon;
    step_lr_  = opt_.lr;
}

bool Trainer::schedule_next_step(ProgressScope & scope) {
    const int64_t step = ggml_opt_get_iter(opt()) - 1;
    float lr           = 0.0f;
    try {
        lr = (*schedule_)(step, horizon_);
        if (!(lr > 0.0f) || !std::isfinite(lr)) {
            throw std::invalid_argument("the schedule returned " + std::to_string(lr) + " for step " +
                                        std::to_string(step) + "; a learning rate is finite and > 0");
        }
    } catch (...) {
        if (defects_(RETRO_DEFECT_HARNESS_04)) {
            return true;  // seeded defect: the schedule's exception is swallowed, the last rate reused
        }
        if (!scope.error) {
            scope.error = std::current_exception();
        }
        return false;
    }
    step_lr_ = lr;
    return true;
}

int64_t Trainer::iteration() {
    return ggml_opt_get_iter(opt());
}

int32_t Trainer::period_position() {
    return ggml_opt_period_pos(opt());
}

bool Trainer::poisoned() {
    return ggml_opt_backend_failed(opt());
}

int64_t Trainer::stop_requests() {
    return llama_opt_stop_requests(ctx());
}

ggml_tensor * Trainer::state_tensor(const std::string & name, int which) {
    ggml_opt_context_t o  = opt();
    const ggml_tensor * t = find_model_tensor(context_->model->get(), name);
    if (!t) {
        return nullptr;
    }
    return which < 0 ? ggml_opt_param_grad_acc(o, t) : ggml_opt_param_moment(o, t, which);
}

void Trainer::prepare_state() {
    const auto call      = training_call();
    llama_context * lctx = ctx();
    clear_recent_errors();
    const int32_t status = llama_opt_prepare_state(lctx);
    if (status != LLAMA_OPT_STATUS_OK) {
        throw training_error(status);
    }
}

void Trainer::set_topology_cache(bool enabled) {
    CallGuard call(held());
    if (llama_opt_set_topology_cache(ctx(), enabled) != LLAMA_OPT_STATUS_OK) {
        throw Error(ErrorKind::InvalidState, "the trainer has no optimizer");
    }
}

llama_opt_topology_stats Trainer::topology_stats() {
    return llama_opt_get_topology_stats(ctx());
}

std::pair<int64_t, int64_t> Trainer::topology_walk() {
    return {llama_opt_topology_foreign_sources(ctx()), llama_opt_topology_stale_addresses(ctx())};
}

void Trainer::set_head(bool fused) {
    CallGuard call(held());
    if (llama_opt_set_head(ctx(), fused ? LLAMA_OPT_HEAD_FUSED : LLAMA_OPT_HEAD_DENSE) != LLAMA_OPT_STATUS_OK) {
        throw Error(ErrorKind::InvalidState, "a trainer keeps the loss head its first step was built with");
    }
    fused_head_ = fused;
}

void Trainer::micro_batch(const int32_t * tokens, const int32_t * labels, int32_t n_tokens, int32_t pos0, bool train) {
    const auto call      = training_call();
    llama_context * lctx = ctx();
    clear_recent_errors();
    const int32_t status = llama_opt_micro_batch(lctx, tokens, labels, n_tokens, pos0, train, nullptr);
    // the step wrote its window's positions to the KV cache, or a failed one dropped the sequence:
    // the next decode goes on from what the cache holds
    context_->n_past = sequence_length(lctx);
    if (status != LLAMA_OPT_STATUS_OK) {
        throw training_error(status);
    }
}

void Trainer::restore(const std::vector<TensorWrite> & writes, std::optional<int64_t> iteration) {
    const TrainingCall call(&held());
    check_checkpoint_state();  // under the guards: no epoch can move the period in between
    std::vector<ggml_tensor *> targets;
    targets.reserve(writes.size());
    for (const TensorWrite & w : writes) {  // every target and size first: nothing is half written
        ggml_tensor * t =
                w.which < 0 ? find_model_tensor(context_->model->get(), w.name) : state_tensor(w.name, w.which);
        if (!t) {
            throw Error(ErrorKind::InvalidState, (w.which < 0 ? "no weight named '" : "no optimizer moment for '") +
                                                         w.name + "' (prepare the state first)");
        }
        if (t->type != GGML_TYPE_F32 || (int64_t) w.count != ggml_nelements(t)) {
            throw std::invalid_argument("cannot write " + std::to_string(w.count) + " float32 values into tensor '" +
                                        ggml_get_name(t) + "'");
        }
        targets.push_back(t);
    }
    for (std::size_t i = 0; i < writes.size(); ++i) {
        write_f32(targets[i], writes[i].values, writes[i].count);
    }
    if (iteration) {  // refused, as set_iteration refuses it, once the tensors are written
        if (*iteration < 1) {
            throw std::invalid_argument("the optimizer iteration starts at 1");
        }
        ggml_opt_set_iter(opt(), *iteration);
    }
}

void Trainer::check_checkpoint_state() {
    if (poisoned()) {
        throw Error(ErrorKind::Poisoned,
                    "an earlier backend compute failed; recreate the trainer and restore a checkpoint");
    }
    if (period_position() != 0) {
        throw Error(ErrorKind::InvalidState, std::to_string(period_position()) +
                                                     " micro-batches into an accumulation period: a checkpoint is "
                                                     "taken and restored at a boundary (after an optimizer step)");
    }
}

void Trainer::set_iteration(int64_t iteration) {
    if (iteration < 1) {
        throw std::invalid_argument("the optimizer iteration starts at 1");
    }
    CallGuard call(held());
    ggml_opt_set_iter(opt(), iteration);
}

}  // namespace retro
