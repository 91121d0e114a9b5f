// Native objects owned by Python: a model, a context on it, a trainer on that context.
// Each holds a shared_ptr to what it depends on, so the native frees run in dependency order
// whatever order Python collects them in.
#pragma once

#include "errors.h"
#include "llama.h"
#include "thread_governor.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace retro {

struct Model {
    llama_model * model = nullptr;
    bool trainable      = false;
    int open_contexts   = 0;  // contexts created on this model and not yet closed

    ~Model() {
        if (model) {
            llama_model_free(model);
        }
    }
    void close() {
        if (open_contexts > 0) {
            throw Error(ErrorKind::InvalidState, "the model still has open contexts; close them first");
        }
        if (model) {
            llama_model_free(model);
            model = nullptr;
        }
    }
    llama_model * get() const {
        if (!model) {
            throw Error(ErrorKind::InvalidState, "the model is closed");
        }
        return model;
    }
};

struct Context {
    std::shared_ptr<Model> model;
    llama_context * ctx = nullptr;
    int32_t n_past      = 0;      // tokens of sequence 0 in the KV cache
    bool has_trainer    = false;  // llama_opt_init holds the context until the trainer closes
    ThreadGovernor threads;       // the CPU threads of each compute

    ~Context() { close(); }
    void close() {
        if (ctx) {
            llama_free(ctx);
            ctx = nullptr;
            model->open_contexts -= 1;
        }
    }
    llama_context * get() const {
        if (!ctx) {
            throw Error(ErrorKind::InvalidState, "the context is closed");
        }
        return ctx;
    }
};

// The geometry a training step sees: llama.cpp caps n_batch at n_ctx and n_ubatch at n_batch.
struct TrainingGeometry {
    uint32_t n_ctx, n_batch, n_ubatch;
};

inline TrainingGeometry training_geometry(const llama_context * ctx) {
    const uint32_t n_ctx   = llama_n_ctx(ctx);
    const uint32_t n_batch = std::min(llama_n_batch(ctx), n_ctx);
    return {n_ctx, n_batch, std::min(llama_n_ubatch(ctx), n_batch)};
}

}  // namespace retro
