#include "graph_probe.h"

#include "errors.h"
#include "tensor_io.h"
#include "ggml.h"

#include <memory>

namespace retro {
namespace {

bool record(ggml_tensor * t, bool ask, void * user_data) {
    if (ask) {
        auto * nodes = static_cast<std::vector<GraphNode> *>(user_data);
        nodes->push_back({t->name,
                          (int) t->type,
                          {t->ne[0], t->ne[1], t->ne[2], t->ne[3]},
                          ggml_is_contiguous(t),
                          tensor_device_name(t)});
    }
    return false;  // metadata only: no node is waited for
}

}  // namespace

std::vector<GraphNode> probe_graph(llama_model * model, int32_t n_tokens, int32_t n_outputs, int32_t n_threads) {
    std::vector<GraphNode> nodes;
    llama_context_params params = llama_context_default_params();
    params.n_ctx                = 256;
    params.n_batch              = 256;
    params.n_ubatch             = 256;
    params.n_seq_max            = 1;
    params.n_threads            = n_threads;
    params.n_threads_batch      = n_threads;
    params.cb_eval              = record;
    params.cb_eval_user_data    = &nodes;
    std::unique_ptr<llama_context, void (*)(llama_context *)> ctx(llama_init_from_model(model, params), llama_free);
    if (!ctx) {
        throw Error(ErrorKind::Context, with_diagnostic("failed to create the probe context"));
    }
    llama_batch batch = llama_batch_init(n_tokens, 0, 1);
    std::unique_ptr<llama_batch, void (*)(llama_batch *)> guard(&batch, [](llama_batch * b) { llama_batch_free(*b); });
    for (int32_t i = 0; i < n_tokens; ++i) {
        batch.token[i]     = i % llama_vocab_n_tokens(llama_model_get_vocab(model));
        batch.pos[i]       = i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i]    = i >= n_tokens - n_outputs;
    }
    batch.n_tokens = n_tokens;
    nodes.clear();  // graph reservation at creation asks nothing, but be sure
    const int32_t rc = llama_decode(ctx.get(), batch);
    if (rc != 0) {
        throw Error(ErrorKind::Decode, with_diagnostic("the probe decode returned " + std::to_string(rc)));
    }
    return nodes;
}

}  // namespace retro
