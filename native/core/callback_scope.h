// The runtime's epoch callback keeps upstream ggml's void ggml_opt_epoch_callback signature, so it
// finds the caller's progress callback through a thread-local stack of scopes, one per (possibly
// nested) epoch call, popped on every exit (CANCEL-08).
#pragma once

#include "ggml-opt.h"
#include "llama.h"

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>

namespace retro {

// progress(train, done, total) -> false to cancel; may throw (the exception cancels and is
// re-thrown when the epoch call returns)
using ProgressFn = std::function<bool(bool train, int64_t done, int64_t total)>;

struct ProgressScope {
    llama_context * ctx = nullptr;
    std::shared_ptr<const ProgressFn> progress;  // empty: no progress callback
    std::exception_ptr error;                    // the first exception progress raised
};

// Pushes a scope for one epoch call; pop() runs on every exit unless `keep` (CANCEL-08's seeded
// defect) leaves it behind.
class ScopeGuard {
public:
    explicit ScopeGuard(std::shared_ptr<ProgressScope> scope);
    ~ScopeGuard();
    void keep() { keep_ = true; }
    ProgressScope & scope() { return *scope_; }

private:
    std::shared_ptr<ProgressScope> scope_;
    bool keep_ = false;
};

// The runtime's epoch callback: calls the progress callback of the innermost scope; false, or an
// exception, requests the stop on that scope's context.
void runtime_epoch_callback(bool train, ggml_opt_context_t opt_ctx, ggml_opt_dataset_t dataset,
                            ggml_opt_result_t result, int64_t ibatch, int64_t ibatch_max, int64_t t_start_us);

}  // namespace retro
