// Errors raised by the native core. The kinds and the statuses that map to them are the tables
// error_kinds.def and training_status.def; the binding turns each kind into its Python class.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace retro {

enum class ErrorKind {
#define X(kind, cls, base, doc) kind,
#include "error_kinds.def"
#undef X
};

struct ErrorKindInfo {
    ErrorKind kind;
    const char * python_class;
    const char * python_base;
    const char * doc;
};

// every kind, bases first (the table's order)
const ErrorKindInfo * error_kinds(std::size_t * count);
const char * python_class_of(ErrorKind kind);

struct Error : std::runtime_error {
    ErrorKind kind;
    Error(ErrorKind kind, const std::string & message) : std::runtime_error(message), kind(kind) {}
};

// The error for a failed llama_opt_status; `off_by_one` is FAIL-01's seeded defect (the status
// table read one row late).
Error training_error(int32_t status, bool off_by_one = false);

// The message of an Error: what failed, then the last warning/error lines the library logged.
std::string with_diagnostic(const std::string & what);

}  // namespace retro
