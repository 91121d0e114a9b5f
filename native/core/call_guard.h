// One call at a time per context: decode, generate, drain, close and every training call (epoch,
// micro-batch, state preparation, the upstream oracle, trainer create and close). A call from
// another thread waits for the running one; a call from the thread already inside (a progress
// callback, schedule or tensor-transaction handler calling back into its own context) is refused
// with a typed error instead of deadlocking. llama.cpp's context is not thread-safe: without this,
// a close from another thread during an epoch freed the scheduler under the running compute.
//
// One writer or reader of a model's weights at a time: a training call holds its model's weights
// for its whole run, and every read or write of them through the API (a weight, every parameter, a
// checkpoint taken or restored, the model saved or closed) waits for it, so that a snapshot taken
// while another thread trains is one step's, never two steps' mixed. Whoever takes both takes the
// weights first, then the context: a thread that holds a context's gate never waits for weights
// (its callbacks may read them, nested, only while it holds them), so a training call's callback
// may call into another context of the model without a cycle. A decode reads the weights without
// their gate: decoding on one context of a model while another trains it reads weights mid-step.
#pragma once

#include "errors.h"
#include "handles.h"

#include <mutex>
#include <optional>
#include <thread>

namespace retro {

class GateGuard {
public:
    // How a call from the thread already inside one is met: a read of state (a parameter, a
    // moment, the cursor) may nest, since the running call holds the gate; anything else is refused.
    enum class Nesting { refused, allowed };

    // Waits for the gate: the binding constructs it with the GIL released.
    GateGuard(CallGate & g, Nesting nesting, const char * refusal) : g_(g) {
        if (g.owner.load() == std::this_thread::get_id()) {
            if (nesting == Nesting::allowed) {
                nested_ = true;
                return;
            }
            throw Error(ErrorKind::InvalidState, refusal);
        }
        g.callers += 1;
        try {
            lock_ = std::unique_lock<std::mutex>(g.busy);
        } catch (...) {
            g.callers -= 1;
            throw;
        }
        g.owner = std::this_thread::get_id();
    }
    ~GateGuard() {
        if (nested_) {
            return;
        }
        g_.owner = std::thread::id();
        g_.callers -= 1;
    }
    GateGuard(const GateGuard &)             = delete;
    GateGuard & operator=(const GateGuard &) = delete;

private:
    CallGate & g_;
    bool nested_ = false;
    std::unique_lock<std::mutex> lock_;
};

// A call on a context.
class CallGuard : public GateGuard {
public:
    using Nesting = GateGuard::Nesting;
    explicit CallGuard(Context & c, Nesting nesting = Nesting::refused)
        : GateGuard(c.calls, nesting,
                    "a callback may not call into the context whose call is running it "
                    "(progress, schedule or tensor-transaction handler)") {}
};

// A read or write of a model's weights (or a training call, which writes them).
class WeightsGuard : public GateGuard {
public:
    using Nesting = GateGuard::Nesting;
    explicit WeightsGuard(Model & m, Nesting nesting = Nesting::refused)
        : GateGuard(m.weights, nesting,
                    "a callback may not write the weights of the model whose training call is running it") {}
};

// What a training call (or a checkpoint written or read) holds for its whole run: its model's
// weights, then its context. A call from the thread inside a call of that context (a callback) is
// refused as CallGuard refuses it, before any wait. Empty under seeded defect
// TX-OWN-04.unguarded-training (constructed with no context).
class TrainingCall {
public:
    explicit TrainingCall(Context * c, GateGuard::Nesting nesting = GateGuard::Nesting::refused) {
        if (c) {
            if (nesting == GateGuard::Nesting::refused && c->calls.owner.load() == std::this_thread::get_id()) {
                CallGuard refused(*c);  // throws the context's refusal
            }
            weights_.emplace(*c->model, nesting);
            call_.emplace(*c, nesting);
        }
    }

private:
    std::optional<WeightsGuard> weights_;
    std::optional<CallGuard> call_;
};

}  // namespace retro
