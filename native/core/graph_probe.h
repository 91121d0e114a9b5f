// The graph a model's decode builds, as the eval callback sees it: what a tensor-transaction
// profile records (node names, types, shapes) so that selectors can be checked against it.
#pragma once

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

namespace retro {

struct GraphNode {
    std::string name;
    int type;  // ggml_type
    int64_t ne[4];
    bool contiguous;
    std::string device;  // where the scheduler put its output: the backend that computes it
};

// Every node of the graphs one decode of n_tokens tokens (the last n_outputs of them with
// logits) computes, in order, on a fresh context of the model. Throws retro::Error on failure.
std::vector<GraphNode> probe_graph(llama_model * model, int32_t n_tokens, int32_t n_outputs, int32_t n_threads);

}  // namespace retro
