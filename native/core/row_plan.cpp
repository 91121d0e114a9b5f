#include "row_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace retro {
namespace {

// the end of a packed window's active span: one past its last document token
int64_t active_end(const int32_t * docs, int64_t width, const Defects & defect) {
    int64_t end = width;
    while (end > 0 && docs[end - 1] < 0) {
        --end;
    }
    if (defect(RETRO_DEFECT_HOST_03) && end > 0) {
        --end;  // seeded defect: the span stops at the last document token instead of after it
    }
    return end;
}

}  // namespace

RowPlan plan_rows(const PlanInput & in, const Defects & defect) {
    if (in.n_ubatch <= 0 || in.width <= 0 || in.width % in.n_ubatch != 0 || in.n_train < 0 ||
        in.n_train > in.n_windows || in.n_sequences < 1) {
        throw std::invalid_argument("row plan: windows must be a multiple of n_ubatch wide");
    }
    RowPlan plan;
    plan.packed = in.documents != nullptr;
    if (plan.packed) {
        plan.seq.resize((size_t) (in.n_windows * in.width));
        plan.pos.resize((size_t) (in.n_windows * in.width));
    }
    plan.spans.assign((size_t) in.n_windows, in.width);
    for (int phase = 0; phase < 2; ++phase) {
        const bool train    = phase == 0;
        const int64_t begin = train ? 0 : in.n_train;
        const int64_t end   = train ? in.n_train : in.n_windows;
        for (int64_t w = begin; w < end; ++w) {
            const int64_t row = w * in.width;
            int64_t span      = in.width;
            if (plan.packed) {
                const int32_t * docs   = in.documents + row;
                span                   = active_end(docs, in.width, defect);
                plan.spans[(size_t) w] = span;
                // one sequence per document (round-robin ids), positions restarting in each
                int64_t ordinal = 0;
                llama_pos p     = 0;
                for (int64_t i = 0; i < in.width; ++i) {
                    const bool padding = i >= span;
                    if (!padding && docs[i] < 0) {
                        throw std::invalid_argument("row plan: padding (-1) only after a window's last document");
                    }
                    if (i > 0 && !padding && docs[i] != docs[i - 1]) {
                        if (docs[i] < docs[i - 1]) {
                            throw std::invalid_argument("row plan: a window's document indices must not decrease");
                        }
                        ++ordinal;
                        p = 0;
                    }
                    plan.seq[(size_t) (row + i)] = (llama_seq_id) (ordinal % in.n_sequences);
                    plan.pos[(size_t) (row + i)] = p++;
                }
            }
            for (int64_t off = 0; off < span; off += in.n_ubatch) {
                const auto active = (int32_t) std::min<int64_t>(in.n_ubatch, span - off);
                if (plan.packed) {
                    // the documents one micro-batch touches must have distinct sequence ids
                    const int64_t first = row + off, last = row + off + active - 1;
                    int64_t touched = 1;
                    for (int64_t i = first + 1; i <= last; ++i) {
                        touched += in.documents[i] != in.documents[i - 1];
                    }
                    if (touched > (int64_t) in.n_sequences) {
                        throw std::invalid_argument("row plan: " + std::to_string(touched) +
                                                    " documents in one micro-batch exceed the context's " +
                                                    std::to_string(in.n_sequences) + " sequences");
                    }
                }
                plan.steps.push_back({w, row + off, (int32_t) in.n_ubatch, active, train});
            }
        }
        if (train) {
            plan.n_train_steps = (int64_t) plan.steps.size();
        }
    }
    return plan;
}

}  // namespace retro
