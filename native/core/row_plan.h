// The row plan of one epoch call (HOST-03): built once from the dataset's arrays before the first
// compute, then only iterated by the loop (epoch.cpp). It says which micro-batches run and what
// each computes: a window's active span (every token of a plain window; a packed window's tokens
// up to the end of its last document) cut into micro-batches of n_ubatch tokens, the last one
// padded up to n_ubatch, so that every token of an accumulation period weighs the same in its
// step; each packed token's sequence (one per document, ids reused round-robin) and position
// (restarting at 0 in every document); and the physical tokens each micro-batch sends to compute.
#pragma once

#include "defects.h"
#include "llama.h"

#include <cstdint>
#include <vector>

namespace retro {

struct PlannedStep {
    int64_t window;    // the dataset row it computes
    int64_t offset;    // its first token, into the [n_windows x width] arrays
    int32_t n_tokens;  // sent to compute, padding included
    int32_t active;    // of them, inside the window's active span (the rest is padding)
    bool train;        // a training micro-batch, or one of the evaluation tail
};

struct RowPlan {
    std::vector<PlannedStep> steps;  // the training phase's, then the evaluation tail's
    int64_t n_train_steps = 0;
    bool packed           = false;
    // packed windows: each token's sequence and position, [n_windows x width] (padding continues
    // its window's last document, which no real token attends to)
    std::vector<llama_seq_id> seq;
    std::vector<llama_pos> pos;
    std::vector<int64_t> spans;  // each window's active span, in tokens

    int64_t steps_in(bool train) const { return train ? n_train_steps : (int64_t) steps.size() - n_train_steps; }
};

// The windows of a call as the plan reads them: tokens and documents are [n_windows x width];
// documents (nullptr: plain windows) give each token's document, non-decreasing along a window,
// with -1 for padding after the last document.
struct PlanInput {
    const int32_t * documents = nullptr;
    int64_t n_windows         = 0;
    int64_t width             = 0;
    int64_t n_train           = 0;
    int64_t n_ubatch          = 0;
    uint32_t n_sequences      = 1;  // the context's sequence ids
};

// Throws std::invalid_argument for input the Python layer lets through by mistake (memberships
// out of order, more documents in one micro-batch than the context has sequences).
RowPlan plan_rows(const PlanInput & in, const Defects & defect);

}  // namespace retro
