// Process-wide plan for fault sites and seeded defects. Sites are hit from whichever thread runs a
// training step and armed from the caller's thread between steps: hit counters and switches are
// atomics, and the armed plan (rarely set) sits behind a mutex that only an armed run takes.
#include "retro-hooks.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace {

struct site_state {
    std::atomic<int64_t> hits{0};
    int64_t failures = 0;
    int64_t fail_at  = 0;  // 0: not armed
    bool persistent  = false;
    int64_t stall_at = 0;  // 0: no stall
    int64_t stall_us = 0;
};

std::mutex g_plan_mutex;
std::atomic<bool> g_armed{false};
site_state g_sites[RETRO_SITE_COUNT];
std::atomic<bool> g_stalling{false};

const char * const k_site_names[] = {
#define X(id, name, status) name,
#include "retro-sites.def"
#undef X
};

bool valid_site(int site) {
    return site >= 0 && site < RETRO_SITE_COUNT;
}

}  // namespace

bool retro_fault_hit(enum retro_site site) {
    if (!valid_site(site)) {
        return false;
    }
    site_state & s = g_sites[site];
    // the count after this pass; seeded defect: the count before it, so a plan fires a hit late
    const int64_t hit =
            s.hits.fetch_add(1, std::memory_order_relaxed) + (retro_defect_on(RETRO_DEFECT_HARNESS_02) ? 0 : 1);
    if (!g_armed.load(std::memory_order_acquire)) {
        return false;
    }
    int64_t stall_us = 0;
    bool fail        = false;
    {
        std::lock_guard<std::mutex> lock(g_plan_mutex);
        fail = s.fail_at > 0 && (hit == s.fail_at || (s.persistent && hit > s.fail_at));
        if (retro_defect_on(RETRO_DEFECT_HARNESS_02_ONCE)) {
            fail = s.fail_at > 0 && hit >= s.fail_at;  // seeded defect: a plan armed once acts as persistent
        }
        s.failures += fail;
        if (s.stall_at > 0 && hit == s.stall_at) {
            stall_us   = s.stall_us;
            s.stall_at = 0;
            g_stalling.store(true);
        }
    }
    if (stall_us > 0) {  // parked outside the plan's lock, so that other threads' sites go on
        std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
        g_stalling.store(false);
    }
    return fail;
}

void retro_fault_stall(enum retro_site site, int64_t hit, int64_t microseconds) {
    if (!valid_site(site)) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_plan_mutex);
    site_state & s = g_sites[site];
    s.stall_at     = hit > 0 && microseconds > 0 ? s.hits.load() + hit : 0;
    s.stall_us     = microseconds;
    g_armed.store(true, std::memory_order_release);
}

bool retro_fault_stalling(void) {
    return g_stalling.load();
}

void retro_fault_arm(enum retro_site site, int64_t hit, bool persistent) {
    if (!valid_site(site)) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_plan_mutex);
    site_state & s = g_sites[site];
    s.fail_at      = hit > 0 ? s.hits.load() + hit : 0;
    s.persistent   = persistent;
    g_armed.store(true, std::memory_order_release);
}

void retro_fault_reset(void) {
    std::lock_guard<std::mutex> lock(g_plan_mutex);
    g_armed.store(false, std::memory_order_release);
    for (site_state & s : g_sites) {
        s.hits.store(0);
        s.failures   = 0;
        s.fail_at    = 0;
        s.persistent = false;
        s.stall_at   = 0;
        s.stall_us   = 0;
    }
}

int64_t retro_fault_hits(enum retro_site site) {
    return valid_site(site) ? g_sites[site].hits.load() : 0;
}

int64_t retro_fault_failures(enum retro_site site) {
    if (!valid_site(site)) {
        return 0;
    }
    std::lock_guard<std::mutex> lock(g_plan_mutex);
    return g_sites[site].failures;
}

const char * retro_site_name(int site) {
    return valid_site(site) ? k_site_names[site] : nullptr;
}

#ifndef RETRO_WITHOUT_SEEDED_DEFECTS
namespace {

std::atomic<bool> g_defects[RETRO_DEFECT_COUNT];

const char * const k_defect_clauses[] = {
#define X(id, clause) clause,
#include "retro-defects.def"
#undef X
};

}  // namespace

const char * retro_defect_clause(int defect) {
    return defect >= 0 && defect < RETRO_DEFECT_COUNT ? k_defect_clauses[defect] : nullptr;
}

bool retro_defect_on(enum retro_defect defect) {
    return defect >= 0 && defect < RETRO_DEFECT_COUNT && g_defects[defect].load(std::memory_order_relaxed);
}

void retro_defect_set(enum retro_defect defect, bool on) {
    if (defect >= 0 && defect < RETRO_DEFECT_COUNT) {
        g_defects[defect].store(on, std::memory_order_relaxed);
    }
}

namespace {
std::atomic<int> g_numerics{RETRO_NUMERICS_CPU};
}  // namespace

enum retro_numerics retro_numerics(void) {
    return static_cast<enum retro_numerics>(g_numerics.load(std::memory_order_relaxed));
}

void retro_numerics_set(enum retro_numerics numerics) {
    const bool known = numerics == RETRO_NUMERICS_GPU_LIKE || numerics == RETRO_NUMERICS_GPU_LIKE_NEAREST;
    g_numerics.store(known ? numerics : RETRO_NUMERICS_CPU, std::memory_order_relaxed);
}
#endif
