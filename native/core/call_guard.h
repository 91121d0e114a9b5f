// One call at a time per context: decode, generate, drain, close and every training call (epoch,
// micro-batch, state preparation, the upstream oracle, trainer create and close). A call from
// another thread waits for the running one; a call from the thread already inside (a progress
// callback, schedule or tensor-transaction handler calling back into its own context) is refused
// with a typed error instead of deadlocking. llama.cpp's context is not thread-safe: without this,
// a close from another thread during an epoch freed the scheduler under the running compute.
#pragma once

#include "errors.h"
#include "handles.h"

#include <mutex>
#include <thread>

namespace retro {

class CallGuard {
public:
    // How a call from the thread already inside one is met: a read of state (a parameter, a
    // moment, the cursor) may nest, since the running call holds the context; anything else is refused.
    enum class Nesting { refused, allowed };

    // Waits for the context: the binding constructs it with the GIL released.
    explicit CallGuard(Context & c, Nesting nesting = Nesting::refused) : c_(c) {
        if (c.owner.load() == std::this_thread::get_id()) {
            if (nesting == Nesting::allowed) {
                nested_ = true;
                return;
            }
            throw Error(ErrorKind::InvalidState,
                        "a callback may not call into the context whose call is running it "
                        "(progress, schedule or tensor-transaction handler)");
        }
        c.callers += 1;
        try {
            lock_ = std::unique_lock<std::mutex>(c.busy);
        } catch (...) {
            c.callers -= 1;
            throw;
        }
        c.owner = std::this_thread::get_id();
    }
    ~CallGuard() {
        if (nested_) {
            return;
        }
        c_.owner = std::thread::id();
        c_.callers -= 1;
    }
    CallGuard(const CallGuard &)             = delete;
    CallGuard & operator=(const CallGuard &) = delete;

private:
    Context & c_;
    bool nested_ = false;
    std::unique_lock<std::mutex> lock_;
};

}  // namespace retro
