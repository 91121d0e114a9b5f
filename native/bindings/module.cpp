// retro._native: the thin native layer. Python validates every input first (retro/), so each
// check below exists only to keep a native assert unreachable.
#include "bindings.h"
#include "logging.h"

#include "llama.h"

PYBIND11_MODULE(_native, m) {
    m.doc() = "retro native layer over the patched llama.cpp";
    // pybind11 looks numpy's C API up on first use, releasing the GIL around a call_once: done
    // there, on a daemon thread's first call while the interpreter exits, the thread woke up
    // mid-finalization inside C++ frames and the process aborted. Done here, at import, instead.
    pybind11::detail::npy_api::get();
    llama_backend_init();
    retro::install_log_sink();
    using namespace retro::bindings;
    bind_errors(m);
    bind_runtime(m);
    bind_model(m);
    bind_transactions(m);
    bind_context(m);
    bind_trainer(m);
    bind_hooks(m);
}
