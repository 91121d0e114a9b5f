// ggml/llama log lines are queued here and drained into Python `logging` by the binding after each
// call (never from inside a native call: a log from a worker thread must not wait for the GIL).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace retro {

void install_log_sink();
std::vector<std::pair<int, std::string>> drain_logs();
std::vector<std::string> recent_errors();
// A test's view of the log in event order (the conformance suite's door, retro._native.hooks): each
// line is also written to `fd` as it is logged, on the logging thread (a blocking write: a reader
// must keep up); a negative fd stops it. Compiled out of a release build, as the seeded defects are.
#ifndef RETRO_WITHOUT_SEEDED_DEFECTS
void mirror_logs(int fd);
#endif
void clear_recent_errors();

}  // namespace retro
