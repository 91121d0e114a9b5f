#include "transactions.h"

#include "ggml-backend.h"
#include "retro-hooks.h"

#include <cmath>
#include <cstring>
#include <string_view>
#include <utility>

namespace retro::tx {
namespace {

bool defect(retro_defect d) {
    return retro_defect_on(d);
}

Failure layout_failure(const char * node, std::string message) {
    return Failure{"layout", node ? node : "", "", std::move(message), ""};
}

bool names_equal(std::string_view node, const std::string & selected) {
    if (defect(RETRO_DEFECT_TX_ACC_02)) {  // seeded defect: a prefix compare
        return node.compare(0, selected.size(), selected) == 0;
    }
    return node == selected;
}

int64_t element_size(DType) {
    return 4;  // f32 and i32
}

bool byte_count_overflows(int64_t elements, int64_t element_bytes, int64_t * bytes) {
    if (defect(RETRO_DEFECT_TX_ACC_06_BYTE_SIGN)) {  // seeded defect: a sign test of the wrapped product
        *bytes = (int64_t) ((uint64_t) elements * (uint64_t) element_bytes);
        return *bytes < 0;
    }
    return __builtin_mul_overflow(elements, element_bytes, bytes);
}

}  // namespace

std::optional<Failure> verify(const Layout & t, const Selector & s, int64_t expected_rows, size_t * bytes_out) {
    if (!t.name || !names_equal(t.name, s.name)) {
        return layout_failure(t.name, "the node is not the selected node '" + s.name + "'");
    }
    const ggml_type want = s.dtype == DType::F32 ? GGML_TYPE_F32 : GGML_TYPE_I32;
    const bool type_ok   = defect(RETRO_DEFECT_TX_ACC_03)
                                   ? ggml_type_size(t.type) == ggml_type_size(want)  // seeded defect
                                   : t.type == want;
    if (!type_ok) {
        return layout_failure(
                t.name, std::string("element type ") + ggml_type_name(t.type) + ", selected " + ggml_type_name(want));
    }
    // the whole tensor's element and byte counts, checked before anything else is compared
    int64_t elements = 0;
    int64_t bytes    = 0;
    if (defect(RETRO_DEFECT_TX_ACC_06)) {  // seeded defect: unchecked products
        elements = (int64_t) ((uint64_t) t.ne[0] * (uint64_t) t.ne[1] * (uint64_t) t.ne[2] * (uint64_t) t.ne[3]);
        bytes    = (int64_t) ((uint64_t) elements * (uint64_t) element_size(s.dtype));
    } else if (__builtin_mul_overflow(t.ne[0], t.ne[1], &elements) ||
               __builtin_mul_overflow(elements, t.ne[2], &elements) ||
               __builtin_mul_overflow(elements, t.ne[3], &elements) ||
               byte_count_overflows(elements, element_size(s.dtype), &bytes) ||
               (uint64_t) bytes > (uint64_t) SIZE_MAX) {
        return layout_failure(t.name, "the element or byte count overflows");
    }
    const bool two_d = defect(RETRO_DEFECT_TX_ACC_04) ? true : (t.ne[2] == 1 && t.ne[3] == 1);  // seeded defect
    if (!two_d || !t.contiguous || t.ne[0] <= 0 || t.ne[1] <= 0) {
        int64_t ne[4] = {t.ne[0], t.ne[1], t.ne[2], t.ne[3]};
        if (defect(RETRO_DEFECT_TX_ACC_04_REPORT)) {
            std::swap(ne[0], ne[1]);  // seeded defect: the shape reported rows first
        }
        return layout_failure(t.name, "not a two-dimensional, non-empty, contiguous tensor [" + std::to_string(ne[0]) +
                                              ", " + std::to_string(ne[1]) + ", " + std::to_string(ne[2]) + ", " +
                                              std::to_string(ne[3]) + "]");
    }
    bool other_width = t.ne[0] != s.row_elements;
    if (defect(RETRO_DEFECT_TX_PROF_02_WIDER)) {  // seeded defect: the width a lower bound, a wider node let through
        other_width = t.ne[0] < s.row_elements;
    }
    if (other_width) {
        return layout_failure(
                t.name, std::to_string(t.ne[0]) + " elements per row, selected " + std::to_string(s.row_elements));
    }
    const bool over_bound = defect(RETRO_DEFECT_TX_ACC_05) ? t.ne[1] >= s.max_rows  // seeded defect: exclusive
                                                           : t.ne[1] > s.max_rows;
    if (over_bound) {
        return layout_failure(t.name,
                              std::to_string(t.ne[1]) + " rows, at most " + std::to_string(s.max_rows) + " selected");
    }
    if (t.ne[1] != expected_rows) {
        return layout_failure(t.name, std::to_string(t.ne[1]) + " rows where the submitted batch has " +
                                              std::to_string(expected_rows) + " in this micro-batch");
    }
    *bytes_out = (size_t) bytes;
    return std::nullopt;
}

Transactions::Transactions(std::vector<Selector> selectors, Handler handler, size_t retained_limit)
    : selectors_(std::move(selectors)),
      handler_(std::move(handler)),
      limit_(retained_limit),
      seen_(selectors_.size()),
      seen_rows_(selectors_.size()) {}

void Transactions::submit(Batch batch) {
    submitted_ = std::move(batch);
}

void Transactions::fail(Failure f) {
    if (!failure_) {
        failure_ = std::move(f);
    }
}

std::vector<Capture> Transactions::drain() {
    std::vector<Capture> out;
    out.swap(committed_);
    committed_bytes_ = 0;
    return out;
}

int64_t Transactions::expected_rows(const Selector & s, int64_t ubatch) const {
    const auto & per = s.rows == Rows::Tokens ? ubatch_tokens_ : ubatch_outputs_;
    if (ubatch >= (int64_t) per.size() && defect(RETRO_DEFECT_TX_ACC_02_REUSED_COUNT) && !per.empty()) {
        return per.back();  // seeded defect: a name met once too often takes the last count
    }
    return ubatch < (int64_t) per.size() ? per[ubatch] : -1;
}

int64_t Transactions::row_offset(const Selector & s, int64_t ubatch) const {
    if (defect(RETRO_DEFECT_TX_ACC_07)) {  // seeded defect: offsets restart in each micro-batch
        return 0;
    }
    const auto & per = s.rows == Rows::Tokens ? ubatch_tokens_ : ubatch_outputs_;
    int64_t offset   = 0;
    for (int64_t u = 0; u < ubatch && u < (int64_t) per.size(); ++u) {
        offset += per[u];
    }
    return offset;
}

bool Transactions::begin(int32_t n_tokens) {
    refused_ = false;
    ran_     = false;
    if (defect(RETRO_DEFECT_TX_FAIL_06)) {  // seeded defect: each decode starts afresh
        failure_.reset();
    }
    if (failure_) {
        if (defect(RETRO_DEFECT_TX_FAIL_06_KIND) && failure_->kind != "handler") {
            return true;  // seeded defect: only a handler's failure refuses the next decode
        }
        return false;  // sticky: nothing runs once a transaction failed
    }
    if (!submitted_ || (int32_t) submitted_->positions.size() != n_tokens) {
        fail({"unsubmitted", "", "", "a decode whose batch retro did not submit: its rows cannot be verified", ""});
        return false;
    }
    batch_ = std::move(*submitted_);
    submitted_.reset();
    ubatch_tokens_.clear();
    ubatch_outputs_.clear();
    output_positions_.clear();
    // llama.cpp splits one sequence's batch into consecutive micro-batches of n_ubatch tokens
    for (size_t start = 0; start < batch_.positions.size(); start += batch_.n_ubatch) {
        const size_t end = std::min(batch_.positions.size(), start + (size_t) batch_.n_ubatch);
        int64_t outputs  = 0;
        for (size_t i = start; i < end; ++i) {
            if (batch_.outputs[i]) {
                outputs += 1;
                output_positions_.push_back(batch_.positions[i]);
            }
        }
        ubatch_tokens_.push_back((int64_t) (end - start));
        ubatch_outputs_.push_back(outputs);
    }
    // the undrained set may not grow past the limit: refuse, before anything runs, a decode
    // whose retained rows would take it there
    size_t incoming = 0;
    for (const auto & s : selectors_) {
        // seeded defect TX-RET-04.outputs: the rows of per-output selectors are left out
        if (s.retain && (s.rows == Rows::Tokens || !defect(RETRO_DEFECT_TX_RET_04_OUTPUTS))) {
            int64_t rows =
                    s.rows == Rows::Tokens ? (int64_t) batch_.positions.size() : (int64_t) output_positions_.size();
            if (defect(RETRO_DEFECT_TX_RET_04_FIRST_MICRO_BATCH) && s.rows == Rows::Tokens) {
                rows = ubatch_tokens_.front();  // seeded defect: the first micro-batch's rows for the decode's
            }
            // seeded defect TX-RET-04.elements: the rows counted in elements, not bytes
            incoming += (size_t) rows * (size_t) s.row_elements * (defect(RETRO_DEFECT_TX_RET_04_ELEMENTS) ? 1 : 4);
        }
    }
    const size_t held = defect(RETRO_DEFECT_TX_RET_04) ? 0 : committed_bytes_;  // seeded defect: per decode
    if (held + incoming > limit_) {
        refused_ = true;
        return false;
    }
    std::fill(seen_.begin(), seen_.end(), 0);
    std::fill(seen_rows_.begin(), seen_rows_.end(), 0);
    if (!defect(RETRO_DEFECT_TX_RET_01)) {  // seeded defect: staging survives from the last decode
        staging_.clear();
    }
    in_decode_ = true;
    ran_       = true;
    return true;
}

bool Transactions::end(int32_t status) {
    in_decode_ = false;
    decodes_ += 1;
    if (defect(RETRO_DEFECT_TX_RET_01_MICRO_BATCHES)) {
        decodes_ += (int64_t) ubatch_tokens_.size() - 1;  // seeded defect: counted per micro-batch
    }
    if (status != 0) {
        staging_.clear();  // the decode failed natively: only its own staging goes
        return true;       // and llama.cpp's own status is what the caller sees
    }
    if (defect(RETRO_DEFECT_TX_RET_02) && !failure_) {  // seeded defect: committed before the coverage check
        for (auto & c : staging_) {
            committed_bytes_ += c.data.size();
            committed_.push_back(std::move(c));
        }
        staging_.clear();
    }
    if (!failure_) {
        for (size_t i = 0; i < selectors_.size(); ++i) {
            const Selector & s = selectors_[i];
            const int64_t wanted =
                    s.rows == Rows::Tokens ? (int64_t) batch_.positions.size() : (int64_t) output_positions_.size();
            const bool absent_ok = defect(RETRO_DEFECT_TX_PROF_02) && seen_[i] == 0;  // seeded defect: fallback
            if (!absent_ok && (seen_[i] != (int64_t) ubatch_tokens_.size() || seen_rows_[i] != wanted)) {
                fail({"coverage", s.name, "",
                      "the selected node was seen in " + std::to_string(seen_[i]) + " of " +
                              std::to_string(ubatch_tokens_.size()) + " micro-batches with " +
                              std::to_string(seen_rows_[i]) + " of " + std::to_string(wanted) +
                              " rows: the graph does not match the profile",
                      ""});
                break;
            }
        }
    }
    if (failure_) {
        if (defect(RETRO_DEFECT_TX_RET_03)) {  // seeded defect: a failure throws away every capture
            committed_.clear();
            committed_bytes_ = 0;
        }
        staging_.clear();
        return false;
    }
    const bool keep_staging = defect(RETRO_DEFECT_TX_RET_01);  // seeded defect: staging survives
    for (auto & c : staging_) {
        committed_bytes_ += c.data.size();
        committed_.push_back(keep_staging ? c : std::move(c));
    }
    if (!keep_staging) {
        staging_.clear();
    }
    return true;
}

bool Transactions::ask(const ggml_tensor * t) const {
    if (!in_decode_ || (failure_ && !defect(RETRO_DEFECT_TX_FAIL_03))) {  // seeded defect: failure ignored
        return false;
    }
    for (const auto & s : selectors_) {
        if (names_equal(t->name, s.name)) {
            return true;
        }
    }
    return false;
}

bool Transactions::data(ggml_tensor * t) {
    if (!in_decode_ || (failure_ && !defect(RETRO_DEFECT_TX_FAIL_03))) {
        return true;
    }
    size_t index = selectors_.size();
    for (size_t i = 0; i < selectors_.size(); ++i) {
        if (names_equal(t->name, selectors_[i].name)) {
            index = i;
            break;
        }
    }
    if (index == selectors_.size()) {
        return true;
    }
    const Selector & s    = selectors_[index];
    const int64_t ubatch  = seen_[index]++;
    const int64_t wanted  = expected_rows(s, ubatch);
    const bool stop_split = defect(RETRO_DEFECT_TX_FAIL_02);  // seeded defect: false ends the split
    if (wanted < 0) {
        fail(layout_failure(t->name,
                            "the selected name names more than one node of the graph, or a node of a "
                            "micro-batch the submitted batch does not have"));
        return !stop_split;
    }
    if (wanted == 0 && t->ne[1] == 0) {
        return true;  // a micro-batch without outputs: nothing of this node to see
    }
    const Layout layout{t->type, {t->ne[0], t->ne[1], t->ne[2], t->ne[3]}, ggml_is_contiguous(t), t->name};
    size_t bytes = 0;
    if (auto f = verify(layout, s, wanted, &bytes)) {
        fail(std::move(*f));
        return !stop_split && !defect(RETRO_DEFECT_TX_FAIL_02_LAYOUT);  // seeded defect: a layout failure stops
    }
    const int64_t first    = row_offset(s, ubatch);
    const auto & positions = s.rows == Rows::Tokens ? batch_.positions : output_positions_;
    Observation obs{index, decodes_, ubatch, first, t->ne[1], positions.data() + first, {}};
    obs.data.resize(bytes);
    // seeded defect: one row's stride taken for the tensor's size
    const size_t copied = defect(RETRO_DEFECT_TX_ACC_08) ? std::min(bytes, t->nb[1]) : bytes;
    ggml_backend_tensor_get(t, obs.data.data(), 0, copied);
    seen_rows_[index] += t->ne[1];

    if (s.borrowed) {
        const size_t n = std::min(bytes, s.borrowed_capacity);
        std::memcpy(s.borrowed, obs.data.data(), n);
    }
    if (handler_) {
        if (auto f = handler_(obs)) {
            fail(std::move(*f));
            return !stop_split;
        }
        if (s.access == Access::MutableF32) {
            const float * v      = reinterpret_cast<const float *>(obs.data.data());
            const int64_t n      = t->ne[0] * t->ne[1];
            const int64_t rowlen = t->ne[0];
            if (defect(RETRO_DEFECT_TX_ACC_10)) {  // seeded defect: rows written back as they pass
                for (int64_t r = 0; r < t->ne[1]; ++r) {
                    for (int64_t j = 0; j < rowlen; ++j) {
                        if (!std::isfinite(v[r * rowlen + j])) {
                            fail({"non-finite", t->name, "",
                                  "the handler left a non-finite value in row " + std::to_string(r), ""});
                            return !stop_split;
                        }
                    }
                    ggml_backend_tensor_set(t, v + r * rowlen, r * t->nb[1], rowlen * sizeof(float));
                }
            } else {
                const int64_t checked = defect(RETRO_DEFECT_TX_ACC_09) ? rowlen : n;  // seeded defect: first row only
                for (int64_t j = 0; j < checked; ++j) {
                    // seeded defect TX-ACC-09.nan-only: the finiteness test is a NaN test
                    if (defect(RETRO_DEFECT_TX_ACC_09_NAN_ONLY) ? std::isnan(v[j]) : !std::isfinite(v[j])) {
                        fail({"non-finite", t->name, "",
                              "the handler left a non-finite value at row " + std::to_string(j / rowlen) +
                                      ", element " + std::to_string(j % rowlen) + ": nothing was written back",
                              ""});
                        return !stop_split;
                    }
                }
                ggml_backend_tensor_set(t, obs.data.data(), 0, bytes);
            }
        }
    }
    if (s.retain) {
        staging_.push_back(Capture{index, decodes_, t->ne[1],
                                   std::vector<int32_t>(obs.positions, obs.positions + t->ne[1]), std::move(obs.data)});
    }
    return true;
}

bool Transactions::eval_callback(ggml_tensor * t, bool ask_phase, void * user_data) {
    auto * self = static_cast<Transactions *>(user_data);
    if (ask_phase) {
        // seeded defect TX-FAIL-03.ask: after a failure every node is asked for (the data phase ignores it)
        const bool need = self->ask(t) || (defect(RETRO_DEFECT_TX_FAIL_03_ASK) && self->failed());
        if (need && defect(RETRO_DEFECT_TX_ACC_01)) {  // seeded defect: data taken in the ask phase
            self->data(t);
            return false;
        }
        return need;
    }
    return self->data(t);
}

bool Transactions::decode_begin(void * user_data, int32_t n_tokens) {
    return static_cast<Transactions *>(user_data)->begin(n_tokens);
}

bool Transactions::decode_end(void * user_data, int32_t status) {
    return static_cast<Transactions *>(user_data)->end(status);
}

}  // namespace retro::tx
