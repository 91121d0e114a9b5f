// Fault-injection sites and seeded-defect switches compiled into the patched llama.cpp.
// With nothing armed every query returns false, so the library behaves as upstream + fixes.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#if defined(_WIN32)
#    define RETRO_HOOKS_API __declspec(dllexport)
#else
#    define RETRO_HOOKS_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Called at a fault site: counts the hit and returns true when the armed plan fails it.
RETRO_HOOKS_API bool retro_fault_hit(const char * site);

// Arm `site` to fail at its `hit`-th hit from now (1-based); `persistent` fails every later hit too.
RETRO_HOOKS_API void retro_fault_arm(const char * site, int64_t hit, bool persistent);

// Disarm every site and zero every hit counter.
RETRO_HOOKS_API void retro_fault_reset(void);

// Count an event that is never failed (a stop request, a limiter sleep): read with retro_fault_hits.
RETRO_HOOKS_API void retro_count(const char * site);

// Hits counted at `site` since the last reset, and how many of them were failed.
RETRO_HOOKS_API int64_t retro_fault_hits(const char * site);
RETRO_HOOKS_API int64_t retro_fault_failures(const char * site);

// Seeded defects: true while the defect for `clause` is switched on.
RETRO_HOOKS_API bool retro_mutant_on(const char * clause);
RETRO_HOOKS_API void retro_mutant_set(const char * clause, bool on);

#ifdef __cplusplus
}
#endif
