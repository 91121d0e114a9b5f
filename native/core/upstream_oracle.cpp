// Upstream's own training loop (llama_opt_epoch) over the same windows as Trainer::epoch: the
// oracle the conformance suite holds the binding's loop against. Windows must be n_ctx wide.
#include "trainer.h"

#include "logging.h"

#include <cstring>
#include <stdexcept>

namespace retro {
namespace {

struct DatasetDeleter {
    void operator()(ggml_opt_dataset * d) const { ggml_opt_dataset_free(d); }
};
struct ResultDeleter {
    void operator()(ggml_opt_result * r) const { ggml_opt_result_free(r); }
};

}  // namespace

void Trainer::upstream_epoch(const EpochRequest & r, EpochMetrics & m) {
    const auto call      = training_call();
    llama_context * lctx = ctx();
    const int64_t n_ctx  = llama_n_ctx(lctx);
    if (r.k != 1 || r.weights) {
        throw std::invalid_argument("upstream's loop trains one unweighted label per token");
    }
    if (fused_head_) {
        throw Error(ErrorKind::InvalidState,
                    "upstream's llama_opt_epoch trains the dense head only: use a dense trainer");
    }
    if (!r.tokens || !r.labels || r.width != n_ctx || r.n_windows < 1 || r.n_train < 0 || r.n_train > r.n_windows) {
        throw std::invalid_argument("upstream's loop takes windows of exactly n_ctx tokens");
    }
    if (ggml_opt_backend_failed(opt())) {
        throw training_error(LLAMA_OPT_STATUS_POISONED);
    }
    std::unique_ptr<ggml_opt_dataset, DatasetDeleter> dataset(
            ggml_opt_dataset_init(GGML_TYPE_I32, GGML_TYPE_I32, n_ctx, n_ctx, r.n_windows, /*ndata_shard =*/1));
    const size_t bytes = sizeof(int32_t) * (size_t) (r.n_windows * n_ctx);
    std::memcpy(ggml_opt_dataset_data(dataset.get())->data, r.tokens, bytes);
    std::memcpy(ggml_opt_dataset_labels(dataset.get())->data, r.labels, bytes);
    std::unique_ptr<ggml_opt_result, ResultDeleter> train(ggml_opt_result_init()), eval(ggml_opt_result_init());
    const int64_t iter0 = iteration();
    clear_recent_errors();
    llama_opt_epoch(lctx, dataset.get(), train.get(), eval.get(), r.n_train, nullptr, nullptr);
    llama_memory_clear(llama_get_memory(lctx), true);
    context_->n_past = 0;
    // a compute failed and poisoned the optimizer (the loop then stops at the next allocation), or
    // the loop stopped before a step's compute (fork patch 0047: that step abandoned at its update
    // boundary, as retro's loop abandons one)
    if (ggml_opt_backend_failed(opt())) {
        throw training_error(LLAMA_OPT_STATUS_COMPUTE);
    }
    if (const int32_t stopped = llama_opt_epoch_status(lctx); stopped != LLAMA_OPT_STATUS_OK) {
        throw training_error(stopped);
    }
    m                 = EpochMetrics{};
    m.optimizer_steps = iteration() - iter0;
    ggml_opt_result_loss(train.get(), &m.train_loss, &m.train_loss_unc);
    ggml_opt_result_accuracy(train.get(), &m.train_accuracy, nullptr);
    int64_t n_eval = 0;
    ggml_opt_result_ndata(eval.get(), &n_eval);
    m.has_eval = n_eval > 0;
    if (m.has_eval) {
        ggml_opt_result_loss(eval.get(), &m.eval_loss, &m.eval_loss_unc);
        ggml_opt_result_accuracy(eval.get(), &m.eval_accuracy, nullptr);
    }
}

}  // namespace retro
