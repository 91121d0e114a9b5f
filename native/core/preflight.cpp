// Preflight: the memory an epoch call will allocate, asked of the fork (llama_opt_preflight) for
// each micro-batch geometry of its row plan and merged, per buffer type and purpose, to the
// largest need: a buffer grows to what a step needs and is kept.
#include "errors.h"
#include "logging.h"
#include "trainer.h"

#include <algorithm>
#include <set>
#include <utility>

namespace retro {

std::vector<BufferNeed> Trainer::preflight(const EpochRequest & r) {
    CallGuard call(held());
    defects_             = Defects::current();
    llama_context * lctx = ctx();
    clear_recent_errors();
    const RowPlan plan = plan_of(r, lctx);
    const int32_t k    = r.documents ? 1 : r.k;  // a packed step stages one target per token

    std::set<std::pair<int32_t, bool>> geometries;  // (tokens sent to compute, backward)
    for (const PlannedStep & step : plan.steps) {
        geometries.insert({step.n_tokens, step.train});
    }
    std::vector<BufferNeed> merged;
    for (const auto & [n_tokens, train] : geometries) {
        llama_opt_buffer_need needs[64];
        int32_t n_needs      = 0;
        const int32_t status = llama_opt_preflight(lctx, n_tokens, k, train, needs, 64, &n_needs);
        if (status != LLAMA_OPT_STATUS_OK) {
            throw training_error(status);
        }
        for (int32_t i = 0; i < n_needs; ++i) {
            const std::string type = needs[i].buffer_type ? needs[i].buffer_type : "host";
            auto it                = std::find_if(merged.begin(), merged.end(), [&](const BufferNeed & b) {
                return b.buffer_type == type && b.purpose == needs[i].purpose;
            });
            if (it == merged.end()) {
                merged.push_back({type, needs[i].purpose, needs[i].needed, needs[i].held});
            } else {
                it->needed = std::max(it->needed, needs[i].needed);
            }
        }
    }
    return merged;
}

std::vector<std::pair<std::string, size_t>> live_buffer_bytes() {
    std::vector<ggml_backend_buffer_type_t> types;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        for (ggml_backend_buffer_type_t t :
             {ggml_backend_dev_buffer_type(dev), ggml_backend_dev_host_buffer_type(dev)}) {
            if (t && std::find(types.begin(), types.end(), t) == types.end()) {
                types.push_back(t);
            }
        }
    }
    std::vector<std::pair<std::string, size_t>> out;
    for (ggml_backend_buffer_type_t t : types) {
        out.emplace_back(ggml_backend_buft_name(t), ggml_backend_buft_live_bytes(t));
    }
    return out;
}

}  // namespace retro
