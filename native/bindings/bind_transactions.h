// Tensor transactions between Python and a Context (bind_transactions.cpp).
#pragma once

#include "bindings.h"
#include "handles.h"

#include <memory>
#include <vector>

namespace retro::bindings {

// retro._native.Transactions: the complete callback state, built at its final heap address before
// any context exists; a context takes it (once) when it is created.
struct PendingTransactions {
    std::vector<tx::Selector> selectors;
    tx::Handler handler;
    size_t limit = 0;
    std::unique_ptr<tx::Transactions> state;  // until a context takes it
    tx::Transactions * original = nullptr;    // its address, for the record
    std::unique_ptr<tx::Transactions> keep;   // seeded defect TX-OWN-02 only

    std::unique_ptr<tx::Transactions> take();
    std::unique_ptr<tx::Transactions> fresh_copy() const;
};

// Move the state into the context and point the eval callback and the decode hooks of params at
// it; returns the address installed.
void * install(Context & c, llama_context_params & params, PendingTransactions & pending);

// The committed captures, drained: (name, decode, positions, data) each.
pybind11::list drain_captures(Context & c);

// The context's sticky transaction failure as (kind, node, type, message, traceback), or None.
pybind11::object transaction_failure(const Context & c);

}  // namespace retro::bindings
