// Native objects owned by Python: a model, a context on it, a trainer on that context.
// Each holds a shared_ptr to what it depends on, so the native frees run in dependency order
// whatever order Python collects them in.
#pragma once

#include "errors.h"
#include "llama.h"
#include "retro-hooks.h"
#include "thread_governor.h"
#include "transactions.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

namespace retro {

// What a call guard waits on (call_guard.h): one call at a time, and the thread inside it.
struct CallGate {
    std::mutex busy;
    std::atomic<std::thread::id> owner{};
    std::atomic<int> callers{0};  // threads inside a call, waiting or running
};

struct Model {
    llama_model * model = nullptr;
    CallGate weights;  // every read and write of the weights, and every training call on them
    bool trainable = false;
    std::atomic<int> open_contexts{0};  // contexts created on this model and not yet closed (any thread)

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
    // The tensor-transaction state llama.cpp calls back into: its address is the context's
    // eval-callback and decode-hook user data, so it is released only after llama_free.
    std::unique_ptr<tx::Transactions> transactions;
    // Every call on the context is serialized by CallGuard (call_guard.h); the gate's owner is the
    // thread inside one, so that a call from that thread (a callback into its own context) is refused.
    CallGate calls;

    ~Context() { close(); }
    void close() {
        if (retro_defect_on(RETRO_DEFECT_TX_OWN_03)) {  // seeded defect: the callback state goes first
            transactions.reset();
        }
        if (ctx) {
            llama_free(ctx);
            ctx = nullptr;
            model->open_contexts -= 1;
        }
        transactions.reset();
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
