// The calls on a Context, whole: opening it with its tensor transactions (the ownership protocol),
// decode, generate, drain, the failure record, reset and close. Each call takes the context's call
// guard itself (call_guard.h), as the trainer's calls do, and ends in one outcome: its result, or
// one Error that carries what the caller may still need (CallError). The binding only converts.
#pragma once

#include "decoding.h"
#include "handles.h"
#include "transactions.h"

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace retro {

// Tensor transactions made before any context exists, at the heap address llama.cpp will call
// back into; exactly one context takes them (TX-OWN-01/02/04).
struct PendingTransactions {
    std::vector<tx::Selector> selectors;
    tx::Handler handler;
    size_t limit = 0;
    std::unique_ptr<tx::Transactions> state;  // until a context takes it
    tx::Transactions * original = nullptr;    // its address, for the record
    std::unique_ptr<tx::Transactions> keep;   // seeded defect TX-OWN-02 only
    std::mutex taking;                        // two contexts opened at once: one takes them

    PendingTransactions(std::vector<tx::Selector> selectors, tx::Handler handler, size_t limit);
    std::unique_ptr<tx::Transactions> take();
    std::unique_ptr<tx::Transactions> fresh_copy() const;
};

struct ContextOptions {
    uint32_t n_ctx = 0, n_batch = 0, n_ubatch = 0;
    int32_t n_threads     = 1;
    bool adaptive_threads = false;
    uint32_t sequences    = 1;  // > 1: packed training, one KV stream for all of them
};

// A failed call on a context, with what it left behind: the first failed transaction's record
// (a TensorCallback error) and, from a generation, the tokens made before the failed decode.
struct CallError : Error {
    std::optional<tx::Failure> failure;
    std::optional<std::vector<int32_t>> tokens;
    CallError(ErrorKind kind, const std::string & message, std::optional<tx::Failure> failure = std::nullopt)
        : Error(kind, message), failure(std::move(failure)) {}
};

// Creates the context; with `transactions`, it takes them (once) and installs llama.cpp's eval
// callback and decode hooks on their state.
std::shared_ptr<Context> open_context(std::shared_ptr<Model> model, const ContextOptions & options,
                                      PendingTransactions * transactions);

struct Logits {
    std::vector<float> values;  // rows x n_vocab, row-major
    int32_t rows = 0, n_vocab = 0;
};

// Appends tokens to sequence 0 and returns their logits. Tokens must be 1..n_batch long, fit the
// context and be ids of its vocabulary (std::invalid_argument otherwise, before anything runs).
Logits decode(Context & c, const int32_t * tokens, int32_t n);

// generate() of decoding.h under both contexts' guards. A failed decode raises a CallError with
// `tokens`; an interruption returns, with `interrupted` set, for the caller to raise.
Generation generate_on(Context & target, const std::vector<int32_t> & prompt, int32_t max_new, Sampling sampling,
                       bool stop_at_eog, Context * draft, int32_t n_draft, const InterruptFn & interrupted);

// The committed captures, in decode order, with the selectors their indices name.
struct Drained {
    std::vector<tx::Capture> captures;
    std::vector<tx::Selector> selectors;
};

Drained drain_captures(Context & c);
std::optional<tx::Failure> transaction_failure(Context & c);  // the sticky first failure
std::string sequence_state(Context & c);                      // llama.cpp's serialization of sequence 0
void reset(Context & c);                                      // forget the sequence
void close(Context & c);

}  // namespace retro
