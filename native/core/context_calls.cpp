#include "context_calls.h"

#include "call_guard.h"
#include "logging.h"

#include <cstring>
#include <optional>
#include <stdexcept>

namespace retro {

PendingTransactions::PendingTransactions(std::vector<tx::Selector> selectors, tx::Handler handler, size_t limit)
    : selectors(std::move(selectors)),
      handler(std::move(handler)),
      limit(limit),
      state(fresh_copy()),
      original(state.get()) {}

std::unique_ptr<tx::Transactions> PendingTransactions::fresh_copy() const {
    return std::make_unique<tx::Transactions>(selectors, handler, limit);
}

std::unique_ptr<tx::Transactions> PendingTransactions::take() {
    std::lock_guard<std::mutex> lock(taking);
    if (!state) {
        if (retro_defect_on(RETRO_DEFECT_TX_OWN_04)) {  // seeded defect: a second owner gets its own copy
            return fresh_copy();
        }
        throw Error(ErrorKind::InvalidState, "these tensor transactions already belong to a context");
    }
    if (retro_defect_on(RETRO_DEFECT_TX_OWN_01)) {  // seeded defect: the context installs a copy
        auto copy = fresh_copy();
        state.reset();
        return copy;
    }
    if (!retro_defect_on(RETRO_DEFECT_TX_OWN_04) && !retro_defect_on(RETRO_DEFECT_TX_OWN_02)) {
        handler = nullptr;  // the state holds the handler now; nothing here may keep it alive
    }
    return std::move(state);
}

namespace {

// Moves the state into the context and points the eval callback and the decode hooks at it.
void install(Context & c, llama_context_params & params, PendingTransactions & pending) {
    c.transactions            = pending.take();
    tx::Transactions * called = c.transactions.get();
    if (retro_defect_on(RETRO_DEFECT_TX_OWN_02)) {  // seeded defect: llama.cpp calls the original, the
        called         = pending.original;          // context owns a moved copy
        pending.keep   = std::move(c.transactions);
        c.transactions = pending.fresh_copy();
    }
    params.cb_eval               = tx::Transactions::eval_callback;
    params.cb_eval_user_data     = called;
    params.decode_hook_user_data = called;
    params.decode_begin          = tx::Transactions::decode_begin;
    params.decode_end            = tx::Transactions::decode_end;
    if (retro_defect_on(RETRO_DEFECT_TX_OWN_05)) {  // seeded defect: retro brackets the caller's decodes only
        params.decode_begin = nullptr;
        params.decode_end   = nullptr;
    }
}

std::string failure_text(const tx::Failure & f) {
    std::string text = "tensor transaction failed (" + f.kind + (f.node.empty() ? "" : ", node '" + f.node + "'") + ")";
    if (!f.type.empty()) {
        text += ": " + f.type;
    }
    return text + ": " + f.message;
}

// After a decode (or a generation's decodes) on c: raise what the transactions or llama.cpp report.
void check_outcome(Context & c, int32_t rc, int32_t n_past_before) {
    if (c.transactions) {
        const tx::Transactions & t = *c.transactions;
        if (t.last_refused()) {
            throw CallError(ErrorKind::CaptureLimit,
                            "the decode's retained captures would take the undrained ones past " +
                                    std::to_string(t.retained_limit()) + " bytes (" +
                                    std::to_string(t.retained_bytes()) + " held): drain them first");
        }
        if (t.failed() && !retro_defect_on(RETRO_DEFECT_TX_FAIL_04)) {       // seeded defect: only rc is looked at
            if (retro_defect_on(RETRO_DEFECT_TX_FAIL_05) && t.last_ran()) {  // seeded defect: rolled back
                llama_memory_seq_rm(llama_get_memory(c.ctx), 0, n_past_before, -1);
                c.n_past = n_past_before;
            }
            throw CallError(ErrorKind::TensorCallback, failure_text(t.failure()), t.failure());
        }
    }
    if (rc != 0) {
        throw CallError(ErrorKind::Decode, with_diagnostic("llama_decode returned " + std::to_string(rc)));
    }
}

}  // namespace

std::shared_ptr<Context> open_context(std::shared_ptr<Model> model, const ContextOptions & o,
                                      PendingTransactions * transactions) {
    if (transactions && llama_context_params_size() != sizeof(llama_context_params)) {
        throw Error(ErrorKind::Context,
                    "the llama library was built from another llama.h (decode hooks ABI): rebuild retro");
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx                = o.n_ctx;
    params.n_batch              = o.n_batch;
    params.n_ubatch             = o.n_ubatch;
    // packed training puts several documents (sequences) in one micro-batch: one KV stream for
    // all of them, so that a micro-batch is never split by sequence
    params.n_seq_max       = std::max<uint32_t>(1, o.sequences);
    params.kv_unified      = o.sequences > 1;
    params.n_threads       = o.n_threads;
    params.n_threads_batch = o.n_threads;
    params.no_perf         = true;
    auto context           = std::make_shared<Context>();
    context->model         = model;
    context->threads       = ThreadGovernor(o.n_threads, o.adaptive_threads);
    if (transactions) {
        install(*context, params, *transactions);
    }
    clear_recent_errors();
    context->ctx = llama_init_from_model(model->get(), params);
    if (!context->ctx) {
        throw Error(ErrorKind::Context, with_diagnostic("failed to create the context"));
    }
    model->open_contexts += 1;
    return context;
}

Logits decode(Context & c, const int32_t * tok, int32_t n) {
    CallGuard call(c);
    llama_context * ctx   = c.get();
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(c.model->get()));
    if (n <= 0 || (uint32_t) n > llama_n_batch(ctx) || (int64_t) c.n_past + n > (int64_t) llama_n_ctx(ctx)) {
        throw std::invalid_argument("tokens must be 1-D, non-empty, at most n_batch long and fit the context");
    }
    for (int32_t i = 0; i < n; ++i) {
        if (tok[i] < 0 || tok[i] >= n_vocab) {
            throw std::invalid_argument("token id out of range");
        }
    }
    const int32_t before = c.n_past;
    clear_recent_errors();
    int32_t rc;
    const bool bracket = c.transactions && retro_defect_on(RETRO_DEFECT_TX_OWN_05);  // seeded defect
    if (bracket && !tx::Transactions::decode_begin(c.transactions.get(), n)) {
        rc = LLAMA_DECODE_HOOK_FAILED;
    } else {
        try {
            rc = decode_tokens(c, tok, n, std::vector<int8_t>((size_t) n, 1));
        } catch (const std::exception & e) {  // e.g. compute buffers that cannot be reserved
            throw CallError(ErrorKind::Decode, with_diagnostic(std::string("llama_decode failed: ") + e.what()));
        }
        if (bracket && !tx::Transactions::decode_end(c.transactions.get(), rc) && rc == 0) {
            rc = LLAMA_DECODE_HOOK_FAILED;
        }
    }
    check_outcome(c, rc, before);
    Logits out;
    out.rows    = n;
    out.n_vocab = n_vocab;
    out.values.resize((size_t) n * (size_t) n_vocab);
    for (int32_t i = 0; i < n; ++i) {
        const float * row = llama_get_logits_ith(ctx, i);
        if (!row) {
            throw CallError(ErrorKind::Decode, with_diagnostic("no logits for output " + std::to_string(i)));
        }
        std::memcpy(out.values.data() + (size_t) i * n_vocab, row, sizeof(float) * n_vocab);
    }
    return out;
}

Generation generate_on(Context & c, const std::vector<int32_t> & prompt, int32_t max_new, Sampling sampling,
                       bool stop_at_eog, Context * draft, int32_t n_draft, const InterruptFn & interrupted) {
    CallGuard call(c);
    std::optional<CallGuard> draft_call;
    if (draft) {
        draft_call.emplace(*draft);
        draft->get();
    }
    c.get();
    const int32_t before       = c.n_past;
    const int32_t draft_before = draft ? draft->n_past : 0;
    clear_recent_errors();
    Generation g = generate(c, prompt, max_new, sampling, stop_at_eog, draft, n_draft, interrupted);
    if (g.failed) {
        try {
            // seeded defect HARNESS-04.handler: only the target's transactions are looked at
            Context & failed = retro_defect_on(RETRO_DEFECT_HARNESS_04_HANDLER) ? c : *g.failed;
            if (retro_defect_on(RETRO_DEFECT_TX_FAIL_05_GENERATION)) {
                failed.n_past = &failed == &c ? before : draft_before;  // seeded defect: n_past rolled back
            }
            check_outcome(failed, g.status, &failed == &c ? before : draft_before);
        } catch (CallError & e) {
            e.tokens = g.tokens;
            throw;
        }
    }
    return g;
}

Drained drain_captures(Context & c) {
    CallGuard call(c);
    if (!c.transactions) {
        return {};
    }
    return {c.transactions->drain(), c.transactions->selectors()};
}

std::optional<tx::Failure> transaction_failure(Context & c) {
    CallGuard call(c);
    if (!c.transactions || !c.transactions->failed()) {
        return std::nullopt;
    }
    tx::Failure failure = c.transactions->failure();
    if (retro_defect_on(RETRO_DEFECT_TX_FAIL_06_READ)) {
        c.transactions->forget_failure();  // seeded defect: reading the failure takes it away
    }
    return failure;
}

std::string sequence_state(Context & c) {
    CallGuard call(c);
    llama_context * ctx = c.get();
    const size_t size   = llama_state_seq_get_size(ctx, 0);
    std::string out(size, '\0');
    out.resize(llama_state_seq_get_data(ctx, (uint8_t *) out.data(), size, 0));
    return out;
}

void reset(Context & c) {
    CallGuard call(c);
    llama_memory_clear(llama_get_memory(c.get()), true);
    c.n_past = 0;
    if (c.transactions && retro_defect_on(RETRO_DEFECT_TX_FAIL_06_RESET)) {
        c.transactions->forget_failure();  // seeded defect: a reset starts the transactions afresh
    }
}

void close(Context & c) {
    CallGuard call(c);
    c.close();
}

}  // namespace retro
