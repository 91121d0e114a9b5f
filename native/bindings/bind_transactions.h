// Tensor transactions between Python and a Context (bind_transactions.cpp).
#pragma once

#include "bindings.h"
#include "context_calls.h"

#include <memory>
#include <vector>

namespace retro::bindings {

// The captures drained from a context: (name, decode, positions, data) each.
pybind11::list to_python(Drained drained);

// A transaction failure as (kind, node, type, message, traceback), or None.
pybind11::object failure_or_none(const std::optional<tx::Failure> & f);

}  // namespace retro::bindings
