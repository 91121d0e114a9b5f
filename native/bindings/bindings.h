// The pybind11 layer: one file per Python type, each converting arguments and results for the
// native core (native/core/) and releasing the GIL around native work.
#pragma once

#include "call_guard.h"
#include "ggml.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <optional>

namespace retro::bindings {

void bind_errors(pybind11::module_ & m);
void bind_runtime(pybind11::module_ & m);
void bind_model(pybind11::module_ & m);
void bind_context(pybind11::module_ & m);
void bind_trainer(pybind11::module_ & m);
void bind_hooks(pybind11::module_ & m);
void bind_transactions(pybind11::module_ & m);

// Threads inside native work with the GIL released (retro._native.calls_in_flight()). At
// interpreter exit retro closes its open objects and lets these calls return before CPython
// finalizes (retro/_handle.py): after that, CPython 3.11 ends a thread that asks for the GIL back
// with pthread_exit, and the unwinding aborts the process as it leaves the destructor that asked.
class InFlight {
public:
    InFlight() { count().fetch_add(1); }
    ~InFlight() { count().fetch_sub(1); }
    InFlight(const InFlight &)             = delete;
    InFlight & operator=(const InFlight &) = delete;
    static std::atomic<int> & count() {
        static std::atomic<int> n{0};
        return n;
    }
};

// Set at interpreter exit once retro has closed everything (retro/_handle.py), before it waits for
// the calls in flight: a call that starts later (on a closed object: it fails at once) keeps the
// GIL, so no thread can enter native code after that wait and ask for the GIL back mid-finalization.
inline std::atomic<bool> & exiting() {
    static std::atomic<bool> flag{false};
    return flag;
}

// The GIL released for native work, and counted (members are destroyed in reverse: the GIL is
// taken back before the count drops). Every release in the binding is one of these. The flag is
// read with the GIL held, as exit sets it: a call either counts before the wait or keeps the GIL.
// The thread state is held as CPython's own pointer, not as an optional gil_scoped_release: g++ 13
// cannot see that an optional's payload is set whenever it is destroyed (-Wmaybe-uninitialized in
// every function that makes one), and the release is exactly pybind11's without disassociation.
class WithoutGil {
public:
    WithoutGil() : saved_(exiting().load() ? nullptr : PyEval_SaveThread()) {}
    ~WithoutGil() {
        if (saved_ != nullptr) {
            PyEval_RestoreThread(saved_);  // before in_flight_ drops: the body runs before members die
        }
    }
    WithoutGil(const WithoutGil &)             = delete;
    WithoutGil & operator=(const WithoutGil &) = delete;

private:
    InFlight in_flight_;
    PyThreadState * saved_;
};

// The context's call guard (native/core/call_guard.h), waited for without the GIL: the call it
// waits on may need the GIL for its callbacks.
class Busy {
public:
    explicit Busy(Context & c, CallGuard::Nesting nesting = CallGuard::Nesting::refused) {
        if (c.ctx == nullptr) {
            return;  // closed: nothing runs on it or waits for it, and the call fails with the GIL held
        }
        WithoutGil release;
        guard_.emplace(c, nesting);
    }

private:
    std::optional<CallGuard> guard_;
};

// The model's weights guard (native/core/call_guard.h), waited for without the GIL: the training
// call it waits on may need the GIL for its callbacks.
class WeightsBusy {
public:
    explicit WeightsBusy(Model & m, WeightsGuard::Nesting nesting) {
        if (m.model == nullptr) {
            return;  // closed: the call fails with the GIL held
        }
        WithoutGil release;
        guard_.emplace(m, nesting);
    }

private:
    std::optional<WeightsGuard> guard_;
};

// a float32 copy of a tensor (any backend), shaped outermost first
pybind11::array_t<float> tensor_to_numpy(const ggml_tensor * t);

}  // namespace retro::bindings
