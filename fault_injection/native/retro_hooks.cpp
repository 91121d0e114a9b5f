// Process-wide plan for fault sites and seeded defects. Sites are hit from whichever thread runs
// a training step; the plan is set from the caller's thread between steps, hence the mutex.
#include "retro-hooks.h"

#include <map>
#include <mutex>
#include <set>
#include <string>

namespace {

struct site_state {
    int64_t hits     = 0;
    int64_t failures = 0;
    int64_t fail_at  = 0;  // 0: not armed
    bool persistent  = false;
};

std::mutex                        g_mutex;
std::map<std::string, site_state> g_sites;
std::set<std::string>             g_mutants;

}  // namespace

bool retro_fault_hit(const char * site) {
    std::lock_guard<std::mutex> lock(g_mutex);
    site_state & s = g_sites[site];
    s.hits += 1;
    const bool fail = s.fail_at > 0 && (s.hits == s.fail_at || (s.persistent && s.hits > s.fail_at));
    s.failures += fail;
    return fail;
}

void retro_count(const char * site) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_sites[site].hits += 1;
}

void retro_fault_arm(const char * site, int64_t hit, bool persistent) {
    std::lock_guard<std::mutex> lock(g_mutex);
    site_state & s = g_sites[site];
    s.fail_at    = hit > 0 ? s.hits + hit : 0;
    s.persistent = persistent;
}

void retro_fault_reset(void) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_sites.clear();
}

int64_t retro_fault_hits(const char * site) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_sites.find(site);
    return it == g_sites.end() ? 0 : it->second.hits;
}

int64_t retro_fault_failures(const char * site) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_sites.find(site);
    return it == g_sites.end() ? 0 : it->second.failures;
}

bool retro_mutant_on(const char * clause) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return !g_mutants.empty() && g_mutants.count(clause) > 0;
}

void retro_mutant_set(const char * clause, bool on) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (on) {
        g_mutants.insert(clause);
    } else {
        g_mutants.erase(clause);
    }
}
