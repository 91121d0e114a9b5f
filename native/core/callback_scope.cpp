#include "callback_scope.h"

#include <algorithm>
#include <vector>

namespace retro {
namespace {

// leaked on purpose: a scope left behind may hold a callback that must not be destroyed at thread exit
thread_local std::vector<std::shared_ptr<ProgressScope>> * t_scopes = nullptr;

std::vector<std::shared_ptr<ProgressScope>> & scopes() {
    if (!t_scopes) {
        t_scopes = new std::vector<std::shared_ptr<ProgressScope>>();
    }
    return *t_scopes;
}

}  // namespace

ScopeGuard::ScopeGuard(std::shared_ptr<ProgressScope> scope) : scope_(std::move(scope)) {
    scopes().push_back(scope_);
}

ScopeGuard::~ScopeGuard() {
    if (!keep_) {
        auto & stack = scopes();
        stack.erase(std::find(stack.begin(), stack.end(), scope_));
    }
}

void runtime_epoch_callback(bool train, ggml_opt_context_t, ggml_opt_dataset_t, ggml_opt_result_t, int64_t ibatch,
                            int64_t ibatch_max, int64_t) {
    if (!t_scopes || t_scopes->empty()) {
        return;
    }
    ProgressScope & scope = *t_scopes->back();
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
