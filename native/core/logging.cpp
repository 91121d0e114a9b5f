#include "logging.h"

#include "errors.h"
#include "llama.h"
#include "text.h"

#include <unistd.h>

#include <atomic>
#include <deque>
#include <mutex>

namespace retro {
namespace {

constexpr size_t kMaxQueued = 4096;  // a chatty backend must not grow memory without bound
constexpr size_t kMaxRecent = 16;

std::mutex g_mutex;
std::vector<std::pair<int, std::string>> g_queue;
std::deque<std::string> g_recent;
std::string g_partial;  // text of a line not yet ended by '\n'
int g_partial_level = GGML_LOG_LEVEL_INFO;
#ifndef RETRO_WITHOUT_SEEDED_DEFECTS
std::atomic<int> g_mirror_fd{-1};
#endif

// the line, as it is logged, to the mirror's file descriptor: the order of writes to one descriptor
// is the order of events, whichever thread later drains the queue (a test hook: a release build
// has none)
void mirror([[maybe_unused]] const std::string & line) {
#ifndef RETRO_WITHOUT_SEEDED_DEFECTS
    const int fd = g_mirror_fd.load(std::memory_order_relaxed);
    if (fd < 0) {
        return;
    }
    const std::string out = line + "\n";
    for (size_t done = 0; done < out.size();) {
        const ssize_t n = ::write(fd, out.data() + done, out.size() - done);
        if (n <= 0) {
            return;  // a closed descriptor loses the mirror's copy, never the queued line
        }
        done += static_cast<size_t>(n);
    }
#endif
}

void push_line(int level, std::string raw) {
    std::string line = valid_utf8(raw);
    mirror(line);
    if (level >= GGML_LOG_LEVEL_WARN) {
        g_recent.push_back(line);
        if (g_recent.size() > kMaxRecent) {
            g_recent.pop_front();
        }
    }
    if (g_queue.size() < kMaxQueued) {
        g_queue.emplace_back(level, std::move(line));
    }
}

void on_log(ggml_log_level level, const char * text, void *) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (level != GGML_LOG_LEVEL_CONT) {
        g_partial_level = level;
    }
    g_partial += text;
    size_t start = 0;
    for (size_t nl; (nl = g_partial.find('\n', start)) != std::string::npos; start = nl + 1) {
        if (nl > start) {
            push_line(g_partial_level, g_partial.substr(start, nl - start));
        }
    }
    g_partial.erase(0, start);
}

}  // namespace

void install_log_sink() {
    llama_log_set(on_log, nullptr);
}

std::vector<std::pair<int, std::string>> drain_logs() {
    std::lock_guard<std::mutex> lock(g_mutex);
    std::vector<std::pair<int, std::string>> out;
    out.swap(g_queue);
    return out;
}

#ifndef RETRO_WITHOUT_SEEDED_DEFECTS
void mirror_logs(int fd) {
    g_mirror_fd.store(fd, std::memory_order_relaxed);
}
#endif

std::vector<std::string> recent_errors() {
    std::lock_guard<std::mutex> lock(g_mutex);
    return {g_recent.begin(), g_recent.end()};
}

void clear_recent_errors() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_recent.clear();
}

std::string with_diagnostic(const std::string & what) {
    std::string msg  = what;
    const auto lines = recent_errors();
    if (!lines.empty()) {
        msg += "\nbackend diagnostic:";
        for (const auto & l : lines) {
            msg += "\n  " + l;
        }
    }
    return msg;
}

}  // namespace retro
