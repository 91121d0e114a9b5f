#include "callback_scope.h"

#include "retro-hooks.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace retro {
namespace {

using ScopeStack = std::vector<std::shared_ptr<ProgressScope>>;

// leaked on purpose: a scope left behind may hold a callback that must not be destroyed at thread exit
thread_local ScopeStack * t_scopes = nullptr;

// seeded defect CANCEL-08.shared-stack: one process-wide stack, as if thread_local were forgotten
// (locked, so that the defect shows as crossed callbacks rather than a corrupted vector)
ScopeStack g_shared_scopes;
std::recursive_mutex g_shared_mutex;

ScopeStack & scopes() {
    if (retro_defect_on(RETRO_DEFECT_CANCEL_08_SHARED_STACK)) {
        return g_shared_scopes;
    }
    if (!t_scopes) {
        t_scopes = new ScopeStack();
    }
    return *t_scopes;
}

std::unique_lock<std::recursive_mutex> lock_if_shared() {
    return retro_defect_on(RETRO_DEFECT_CANCEL_08_SHARED_STACK) ? std::unique_lock<std::recursive_mutex>(g_shared_mutex)
                                                                : std::unique_lock<std::recursive_mutex>();
}

}  // namespace

ScopeGuard::ScopeGuard(std::shared_ptr<ProgressScope> scope) : scope_(std::move(scope)) {
    auto lock = lock_if_shared();
    scopes().push_back(scope_);
}

ScopeGuard::~ScopeGuard() {
    if (!keep_) {
        auto lock    = lock_if_shared();
        auto & stack = scopes();
        auto it      = std::find(stack.begin(), stack.end(), scope_);
        if (it != stack.end()) {
            stack.erase(it);
        }
    }
}

void runtime_epoch_callback(bool train, ggml_opt_context_t, ggml_opt_dataset_t, ggml_opt_result_t, int64_t ibatch,
                            int64_t ibatch_max, int64_t) {
    std::shared_ptr<ProgressScope> innermost;
    {
        auto lock          = lock_if_shared();
        const auto & stack = scopes();
        if (stack.empty()) {
            return;
        }
        innermost = stack.back();
    }
    ProgressScope & scope = *innermost;
    if (!scope.progress) {
        return;
    }
    bool go_on = true;
    try {
        go_on = (*scope.progress)(train, ibatch, ibatch_max);
    } catch (...) {
        if (!scope.error) {
            scope.error = std::current_exception();
        }
        go_on = false;
    }
    if (!go_on && scope.ctx) {
        llama_opt_request_stop(scope.ctx);
    }
}

}  // namespace retro
