// Errors raised by the native layer. Each kind maps to one Python class in retro/errors.py;
// the message carries the backend's own diagnostic lines.
#pragma once

#include <stdexcept>
#include <string>

namespace retro {

enum class ErrorKind {
    Load,            // model file could not be loaded
    Context,         // context could not be created
    Decode,          // llama_decode failed
    BatchInit,       // before-compute failures of a training step
    MemoryInit,
    OutputReserve,
    GraphBuild,
    Allocation,
    Compute,         // backend compute failed: the trainer is poisoned
    Poisoned,        // refused: an earlier compute failed
    InvalidState,    // closed handle, second trainer on a context, ...
};

struct Error : std::runtime_error {
    ErrorKind kind;
    Error(ErrorKind kind, const std::string & message) : std::runtime_error(message), kind(kind) {}
};

// The message of an Error: what failed, then the last warning/error lines the library logged.
std::string with_diagnostic(const std::string & what);

}  // namespace retro
