#include "errors.h"

#include "llama.h"
#include "retro-hooks.h"

namespace retro {
namespace {

const ErrorKindInfo k_kinds[] = {
#define X(kind, cls, base, doc) {ErrorKind::kind, cls, base, doc},
#include "error_kinds.def"
#undef X
};

struct StatusInfo {
    int32_t status;
    ErrorKind kind;
    const char * message;
};

const StatusInfo k_statuses[] = {
#define X(status, kind, message) {LLAMA_OPT_STATUS_##status, ErrorKind::kind, message},
#include "training_status.def"
#undef X
};

}  // namespace

const ErrorKindInfo * error_kinds(std::size_t * count) {
    *count = sizeof(k_kinds) / sizeof(k_kinds[0]);
    return k_kinds;
}

const char * python_class_of(ErrorKind kind) {
    for (const auto & k : k_kinds) {
        if (k.kind == kind) {
            return k.python_class;
        }
    }
    return "RetroError";
}

Error training_error(int32_t status) {
    const bool off_by_one   = retro_defect_on(RETRO_DEFECT_FAIL_01);
    constexpr std::size_t n = sizeof(k_statuses) / sizeof(k_statuses[0]);
    for (std::size_t i = 0; i < n; ++i) {
        if (k_statuses[i].status == status) {
            const StatusInfo & s = k_statuses[off_by_one ? (i + 1) % n : i];
            return Error(s.kind, with_diagnostic(s.message));
        }
    }
    return Error(ErrorKind::Training, with_diagnostic("unknown training status " + std::to_string(status)));
}

}  // namespace retro
