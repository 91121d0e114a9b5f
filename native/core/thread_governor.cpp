#include "thread_governor.h"

#include "retro-hooks.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#if defined(__linux__)
#include <dirent.h>
#include <sched.h>
#include <unistd.h>
#endif

namespace retro {
namespace {

#if defined(__linux__)
// The state letter of /proc/<...>/stat: the field after the command, which may itself hold ')'.
bool task_running(const char * stat_path) {
    FILE * f = std::fopen(stat_path, "re");
    if (!f) {
        return false;
    }
    char buf[512];
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n]             = '\0';
    const char * paren = std::strrchr(buf, ')');
    return paren && paren[1] == ' ' && paren[2] == 'R';
}

int32_t procs_running() {
    // /proc/loadavg: "0.58 1.95 2.50 3/83 29747": the fourth field is running/total
    FILE * f = std::fopen("/proc/loadavg", "re");
    if (!f) {
        return -1;
    }
    double a, b, c;
    int running = -1, total = 0;
    if (std::fscanf(f, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) {
        running = -1;
    }
    std::fclose(f);
    return running;
}

int32_t own_running_tasks() {
    DIR * dir = opendir("/proc/self/task");
    if (!dir) {
        return -1;
    }
    int32_t n = 0;
    char path[64];
    while (const dirent * e = readdir(dir)) {
        if (e->d_name[0] == '.') {
            continue;
        }
        std::snprintf(path, sizeof(path), "/proc/self/task/%.20s/stat", e->d_name);
        n += task_running(path) ? 1 : 0;
    }
    closedir(dir);
    return n;
}

int32_t usable_cores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        return std::max(1, CPU_COUNT(&set));
    }
    return std::max<int32_t>(1, (int32_t) sysconf(_SC_NPROCESSORS_ONLN));
}

int32_t online_cores() {
    return std::max<int32_t>(1, (int32_t) sysconf(_SC_NPROCESSORS_ONLN));
}
#endif

}  // namespace

int32_t runnable_elsewhere() {
#if defined(__linux__)
    const int32_t all = procs_running();
    if (all == 1) {
        return 0;  // the thread reading is the one running task (the common case, kept cheap)
    }
    // a thread of ours that stops between two reads would count as somebody else's: count ours
    // on both sides of the machine-wide read and keep the larger
    const int32_t own_before = own_running_tasks();
    const int32_t all_again  = procs_running();
    const int32_t own_after  = own_running_tasks();
    if (all_again < 0 || own_before < 0 || own_after < 0) {
        return -1;
    }
    int32_t own = std::max(own_before, own_after);
    if (retro_defect_on(RETRO_DEFECT_BASE_02_OWN_THREADS)) {
        own = 0;  // seeded defect: this process's own runnable threads taken for others'
    }
    return std::max(0, all_again - own);
#else
    return -1;
#endif
}

int32_t ThreadGovernor::choose() {
    if (!adaptive_) {
        return ceiling_;
    }
#if defined(__linux__)
    const int32_t seen = runnable_elsewhere();
    if (seen < 0) {
        return ceiling_;
    }
    // a busy process stays runnable; a task that ran for a moment (a shell, a daemon) is gone by
    // the next sample: threads are given up only for what two samples in a row saw
    const int32_t others = std::min(seen, previous_others_);
    previous_others_     = seen;
    // the machine's free cores, within the cores this process may use: a container that sees the
    // host's tasks in /proc/loadavg also counts the host's cores
    const int32_t free_cores = std::min(usable_cores(), online_cores() - others);
    return std::clamp(free_cores, 1, ceiling_);
#else
    return ceiling_;
#endif
}

void ThreadGovernor::apply(llama_context * ctx) {
    const int32_t n = choose();
    if (n != current_) {
        llama_set_n_threads(ctx, n, n);
        current_ = n;
    }
}

}  // namespace retro
