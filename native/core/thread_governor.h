// How many CPU threads the next compute gets. ggml's threads wait for each other at a barrier
// after every graph node by spinning; on a core that another process also wants, a descheduled
// thread stalls all the others, and a compute becomes 5-60x slower. One fewer thread costs at most
// its share. So, unless the caller fixed the count, each compute gets the cores no other runnable
// task holds right now (at least one, at most the caller's ceiling).
#pragma once

#include "llama.h"

#include <cstdint>

namespace retro {

// Runnable tasks on the machine that are not threads of this process, or -1 where the system
// does not say (it reads /proc/loadavg and /proc/self/task on Linux).
int32_t runnable_elsewhere();

class ThreadGovernor {
public:
    ThreadGovernor() = default;
    ThreadGovernor(int32_t ceiling, bool adaptive)
        : ceiling_(ceiling < 1 ? 1 : ceiling), adaptive_(adaptive), current_(ceiling_) {}

    // the thread count for the next compute: the ceiling when fixed, else the free cores
    int32_t choose();
    // choose, and give the context that count if it changed (the context starts at the ceiling)
    void apply(llama_context * ctx);

    int32_t ceiling() const { return ceiling_; }
    bool adaptive() const { return adaptive_; }
    int32_t current() const { return current_; }  // the count the context has now

private:
    int32_t ceiling_         = 1;
    bool adaptive_           = false;
    int32_t current_         = 1;
    int32_t previous_others_ = INT32_MAX;  // runnable tasks elsewhere at the previous sample (none yet)
};

}  // namespace retro
