#include "decoding.h"

#include <algorithm>
#include <memory>

namespace retro {

int32_t sequence_length(llama_context * ctx) {
    return llama_memory_seq_pos_max(llama_get_memory(ctx), 0) + 1;
}

namespace {

int32_t argmax_row(Context & c, int32_t output) {
    const float * row = llama_get_logits_ith(c.ctx, output);
    const int32_t n   = llama_vocab_n_tokens(llama_model_get_vocab(c.model->get()));
    return (int32_t) (std::max_element(row, row + n) - row);
}

bool is_eog(Context & c, int32_t token) {
    return llama_vocab_is_eog(llama_model_get_vocab(c.model->get()), token);
}

// Forget positions pos.. of sequence 0 (tokens a draft proposed that the target did not keep).
void truncate(Context & c, int32_t pos) {
    llama_memory_seq_rm(llama_get_memory(c.ctx), 0, pos, -1);
    c.n_past = sequence_length(c.ctx);
}

std::vector<int8_t> last_only(size_t n) {
    std::vector<int8_t> out(n, 0);
    out.back() = 1;
    return out;
}

}  // namespace

int32_t decode_tokens(Context & c, const int32_t * tokens, int32_t n, const std::vector<int8_t> & outputs) {
    llama_batch batch = llama_batch_init(n, 0, 1);
    std::unique_ptr<llama_batch, void (*)(llama_batch *)> guard(&batch, [](llama_batch * b) { llama_batch_free(*b); });
    tx::Batch submitted{std::vector<int32_t>((size_t) n), outputs, llama_n_ubatch(c.ctx)};
    for (int32_t i = 0; i < n; ++i) {
        batch.token[i]         = tokens[i];
        batch.pos[i]           = c.n_past + i;
        batch.n_seq_id[i]      = 1;
        batch.seq_id[i][0]     = 0;
        batch.logits[i]        = outputs[(size_t) i];
        submitted.positions[i] = c.n_past + i;
    }
    batch.n_tokens = n;
    if (c.transactions) {
        c.transactions->submit(std::move(submitted));
    }
    c.threads.apply(c.ctx);
    const int32_t rc = llama_decode(c.ctx, batch);
    c.n_past         = sequence_length(c.ctx);
    return rc;
}

Generation generate(Context & target, const std::vector<int32_t> & prompt, int32_t max_new, Sampling sampling,
                    bool stop_at_eog, Context * draft, int32_t n_draft, const InterruptFn & interrupted) {
    Generation g;
    auto stop_asked = [&] {
        g.interrupted = interrupted && interrupted();
        return g.interrupted;
    };
    auto failed = [&g](Context & c, int32_t rc) {
        if (rc != 0) {  // a failed transaction fails its decode too: the decode_end hook says so
            g.status = rc;
            g.failed = &c;
        }
        return rc != 0;
    };
    std::unique_ptr<llama_sampler, void (*)(llama_sampler *)> sampler(nullptr, llama_sampler_free);
    if (sampling.temperature > 0.0f) {
        sampler.reset(llama_sampler_chain_init(llama_sampler_chain_default_params()));
        llama_sampler_chain_add(sampler.get(), llama_sampler_init_temp(sampling.temperature));
        llama_sampler_chain_add(sampler.get(), llama_sampler_init_dist(sampling.seed));
    }
    auto next_token = [&](Context & c, int32_t output) {
        return sampler ? llama_sampler_sample(sampler.get(), c.ctx, output) : argmax_row(c, output);
    };
    auto done = [&](int32_t token) {
        return stop_at_eog && is_eog(target, token);
    };

    g.decodes += 1;
    if (failed(target, decode_tokens(target, prompt.data(), (int32_t) prompt.size(), last_only(prompt.size())))) {
        return g;
    }
    int32_t last = next_token(target, -1);
    g.tokens.push_back(last);
    if (done(last)) {
        return g;
    }
    if (!draft) {
        while ((int32_t) g.tokens.size() < max_new && !stop_asked()) {
            g.decodes += 1;
            if (failed(target, decode_tokens(target, &last, 1, {1}))) {
                return g;
            }
            last = next_token(target, -1);
            g.tokens.push_back(last);
            if (done(last)) {
                return g;
            }
        }
        return g;
    }

    // the draft holds the prompt too; `behind` are accepted tokens the draft has not decoded yet
    if (failed(*draft, decode_tokens(*draft, prompt.data(), (int32_t) prompt.size(), last_only(prompt.size())))) {
        return g;
    }
    std::vector<int32_t> behind;
    while ((int32_t) g.tokens.size() < max_new && !stop_asked()) {
        const int32_t base = target.n_past;  // position of `last`
        const int32_t k    = std::min(n_draft, max_new - (int32_t) g.tokens.size() - 1);
        std::vector<int32_t> proposal{last};
        if (k > 0) {
            behind.push_back(last);
            if (failed(*draft,
                       decode_tokens(*draft, behind.data(), (int32_t) behind.size(), last_only(behind.size())))) {
                return g;
            }
            behind.clear();
            proposal.push_back(argmax_row(*draft, -1));
            for (int32_t i = 1; i < k; ++i) {
                int32_t t = proposal.back();
                if (failed(*draft, decode_tokens(*draft, &t, 1, {1}))) {
                    return g;
                }
                proposal.push_back(argmax_row(*draft, -1));
            }
            g.drafted += k;
        }
        g.decodes += 1;
        const std::vector<int8_t> all((size_t) proposal.size(), 1);
        if (failed(target, decode_tokens(target, proposal.data(), (int32_t) proposal.size(), all))) {
            return g;
        }
        // keep the target's own token at each row while it agrees with the draft's next one
        int32_t kept = 0;
        for (int32_t i = 0; i < (int32_t) proposal.size(); ++i) {
            const int32_t t = argmax_row(target, i);
            g.tokens.push_back(t);
            kept = i + 1;
            last = t;
            if (done(t) || (int32_t) g.tokens.size() >= max_new) {
                break;
            }
            if (i + 1 < (int32_t) proposal.size() && proposal[(size_t) i + 1] != t) {
                break;
            }
            if (i + 1 < (int32_t) proposal.size()) {
                g.accepted += 1;
            }
        }
        // the target keeps the inputs it agreed with: `last`'s predecessor chain up to row kept-1
        truncate(target, base + kept);
        if (k > 0) {
            // the draft decoded proposal[0..k-1]; it keeps those the target kept
            const int32_t draft_kept = std::min(kept, k);
            truncate(*draft, base + draft_kept);
            if (kept > k) {
                behind.push_back(proposal[(size_t) k]);
            }
        } else {
            behind.push_back(proposal[0]);
        }
        if (done(last)) {
            break;
        }
    }
    return g;
}

}  // namespace retro
