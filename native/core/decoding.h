// Decoding and generation on a Context: the one place that builds llama batches, submits them to
// the context's tensor transactions and calls llama_decode, so that the caller's decodes and the
// internal decodes of a generation run through the same transaction hooks.
#pragma once

#include "handles.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace retro {

// Positions of sequence 0 in the KV cache: llama.cpp's own record, which the next decode follows.
int32_t sequence_length(llama_context * ctx);

// Decode n tokens at positions n_past.. of sequence 0, with logits for the rows where outputs[i]
// is set; updates n_past from the KV cache (llama.cpp's own record, whatever the outcome).
int32_t decode_tokens(Context & c, const int32_t * tokens, int32_t n, const std::vector<int8_t> & outputs);

struct Sampling {
    float temperature = 0.0f;  // 0: greedy
    uint32_t seed     = 0;
};

struct Generation {
    std::vector<int32_t> tokens;  // generated, in order
    int32_t status   = 0;         // llama_decode's status of the decode that failed, 0 when none did
    Context * failed = nullptr;   // the context whose decode failed
    int64_t decodes  = 0;         // llama_decode calls on the target
    int64_t drafted  = 0;         // tokens the draft proposed
    int64_t accepted = 0;         // of those, accepted by the target
    bool interrupted = false;     // stopped because `interrupted` said so (a pending signal)
};

// Asked before every decode after the prompt's: true stops the generation there (the caller
// raises what interrupted it, e.g. Ctrl-C's KeyboardInterrupt). May be empty.
using InterruptFn = std::function<bool()>;

// Append prompt to the sequence and generate up to max_new tokens (stopping after an
// end-of-generation token when stop_at_eog). With a draft context, greedy speculative decoding:
// the draft proposes n_draft tokens, the target checks them in one decode and keeps the longest
// prefix it agrees with; the tokens are those plain greedy decoding gives.
Generation generate(Context & target, const std::vector<int32_t> & prompt, int32_t max_new, Sampling sampling,
                    bool stop_at_eog, Context * draft, int32_t n_draft, const InterruptFn & interrupted = {});

}  // namespace retro
