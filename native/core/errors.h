// Errors raised by the native core. The kinds and the statuses that map to them are the tables
// error_kinds.def and training_status.def; the binding turns each kind into its Python class.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "text.h"

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
    // the message may quote a model file's bytes: it is made valid UTF-8 for Python
    Error(ErrorKind kind, const std::string & message) : std::runtime_error(valid_utf8(message)), kind(kind) {}
};

// The error for a failed llama_opt_status, from the one table of statuses (training_status.def);
// with FAIL-01's seeded defect on, the table is read one row late, on every path that raises.
Error training_error(int32_t status);

// The message of an Error: what failed, then the last warning/error lines the library logged.
std::string with_diagnostic(const std::string & what);

}  // namespace retro
