// Tensor transactions: the native side of ggml_backend_sched_eval_callback and of the decode hooks
// (vendor patch 0022). A Transactions object lives at one heap address for its whole life: that
// address is the eval-callback and decode-hook user data, so it is created before the context and
// freed only after llama_free. It reads or edits the selected graph nodes of the decodes retro
// submits, checks every layout before it copies, contains every handler failure and stages
// retained captures per decode. The handler is a plain std::function: no Python here.
#pragma once

#include "ggml.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace retro::tx {

enum class DType : int { F32 = 0, I32 = 1 };
enum class Access : int { Read = 0, MutableF32 = 1 };
// Which logical rows of the submitted batch a node carries: one per token, or one per output.
enum class Rows : int { Tokens = 0, Outputs = 1 };

struct Selector {
    std::string name;  // the node's full name, byte for byte
    DType dtype;
    int64_t row_elements;
    int64_t max_rows;  // inclusive
    Access access;
    bool retain;
    Rows rows;
    // TensorCapture, the older borrowed-state capture: the node's last rows are written straight
    // into caller memory this object does not own (see retro.unsafe).
    void * borrowed          = nullptr;
    size_t borrowed_capacity = 0;
};

// Bounds on what a caller may ask for (checked again here; the binding validates them first).
inline constexpr size_t kMaxSelectors    = 64;
inline constexpr size_t kMaxNameLength   = GGML_MAX_NAME - 1;
inline constexpr int64_t kMaxRows        = 1 << 20;
inline constexpr int64_t kMaxRowElements = 1 << 24;
inline constexpr size_t kMaxFailureText  = 4096;  // message and traceback, each
inline constexpr size_t kMaxFailureType  = 256;

// A contained failure: what the context reports, as text only (no exception object survives).
struct Failure {
    std::string kind;  // "handler", "layout", "coverage", "non-finite", "unsubmitted", "limit"
    std::string node;
    std::string type;  // the exception's qualified type name, for "handler"
    std::string message;
    std::string traceback;
};

// One selected node's data in one micro-batch: an owned copy, given to the handler.
struct Observation {
    size_t selector;
    int64_t decode;     // native decodes since the context was created
    int64_t ubatch;     // micro-batch within that decode
    int64_t first_row;  // logical row of the submitted batch its first row is
    int64_t rows;
    const int32_t * positions;  // rows positions of those logical rows
    std::vector<unsigned char> data;
};

// A retained capture, committed when its decode succeeded with every row of every selector seen.
struct Capture {
    size_t selector;
    int64_t decode;
    int64_t rows;
    std::vector<int32_t> positions;
    std::vector<unsigned char> data;
};

// Called in the data phase; may edit a MutableF32 observation's data in place. Returns the failure
// it caught, if any. Never throws.
using Handler = std::function<std::optional<Failure>(Observation &)>;

// What retro submits for the next decode: the positions and output flags of its logical rows.
struct Batch {
    std::vector<int32_t> positions;
    std::vector<int8_t> outputs;
    uint32_t n_ubatch = 0;
};

// Checked layout arithmetic (TX-ACC-03..07), also used directly by the conformance suite.
struct Layout {
    ggml_type type;
    int64_t ne[4];
    bool contiguous;
    const char * name;
};
std::optional<Failure> verify(const Layout & t, const Selector & s, int64_t expected_rows, size_t * bytes_out);

class Transactions {
public:
    Transactions(std::vector<Selector> selectors, Handler handler, size_t retained_limit);
    Transactions(const Transactions &)             = delete;
    Transactions & operator=(const Transactions &) = delete;

    // the C callbacks; user_data is this object
    static bool eval_callback(ggml_tensor * t, bool ask, void * user_data);
    static bool decode_begin(void * user_data, int32_t n_tokens);
    static bool decode_end(void * user_data, int32_t status);

    void submit(Batch batch);  // before each llama_decode retro makes

    bool failed() const { return failure_.has_value(); }
    void forget_failure() { failure_.reset(); }  // only seeded defects (TX-FAIL-06.reset, .read) call it
    const Failure & failure() const { return *failure_; }
    bool last_refused() const { return refused_; }  // the last decode was refused by the limit
    bool last_ran() const { return ran_; }          // the last decode got past its begin hook
    int64_t decodes() const { return decodes_; }
    size_t retained_bytes() const { return committed_bytes_; }
    size_t retained_limit() const { return limit_; }
    const std::vector<Selector> & selectors() const { return selectors_; }
    std::vector<Capture> drain();

private:
    bool ask(const ggml_tensor * t) const;
    bool data(ggml_tensor * t);
    bool begin(int32_t n_tokens);
    bool end(int32_t status);
    void fail(Failure f);
    int64_t expected_rows(const Selector & s, int64_t ubatch) const;
    int64_t row_offset(const Selector & s, int64_t ubatch) const;

    std::vector<Selector> selectors_;
    Handler handler_;
    size_t limit_;

    std::optional<Failure> failure_;  // the first failure, kept for the context's lifetime
    bool in_decode_  = false;
    bool refused_    = false;
    bool ran_        = false;
    int64_t decodes_ = 0;
    std::optional<Batch> submitted_;
    Batch batch_;
    std::vector<int64_t> ubatch_tokens_, ubatch_outputs_;  // rows of each micro-batch
    std::vector<int32_t> output_positions_;
    std::vector<int64_t> seen_, seen_rows_;  // per selector, in this decode
    std::vector<Capture> staging_, committed_;
    size_t committed_bytes_ = 0;
};

}  // namespace retro::tx
