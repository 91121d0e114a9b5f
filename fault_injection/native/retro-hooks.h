// Fault sites and seeded-defect switches compiled into the patched llama.cpp (C ABI, used by the
// fork's ggml-opt and llama-context and by the binding). With nothing armed and no defect on,
// every query is one relaxed atomic load and the library behaves as upstream plus our fixes.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#if defined(_WIN32)
#define RETRO_HOOKS_API __declspec(dllexport)
#else
#define RETRO_HOOKS_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum retro_site {
#define X(id, name, status) RETRO_SITE_##id,
#include "retro-sites.def"
#undef X
    RETRO_SITE_COUNT
};

enum retro_defect {
#define X(id, clause) RETRO_DEFECT_##id,
#include "retro-defects.def"  // generated from conformance/mutants.toml (write_defect_switches.py)
#undef X
    RETRO_DEFECT_COUNT
};

// Called at a fault site: counts the hit and returns true when the armed plan fails it.
RETRO_HOOKS_API bool retro_fault_hit(enum retro_site site);

// Arm `site` to fail at its `hit`-th hit from now (1-based); `persistent` fails every later hit too.
RETRO_HOOKS_API void retro_fault_arm(enum retro_site site, int64_t hit, bool persistent);

// Park the thread that makes the `hit`-th hit of `site` from now (1-based) for `microseconds`
// before the site goes on: a call held inside real work, its guard and graph taken, so that a check
// can make calls from other threads meanwhile (TX-OWN-04). One stall at a time; reset clears it.
RETRO_HOOKS_API void retro_fault_stall(enum retro_site site, int64_t hit, int64_t microseconds);

// True while a thread is parked by a stall.
RETRO_HOOKS_API bool retro_fault_stalling(void);

// Disarm every site and zero every hit counter.
RETRO_HOOKS_API void retro_fault_reset(void);

// Hits counted at `site` since the last reset, and how many of them were failed.
RETRO_HOOKS_API int64_t retro_fault_hits(enum retro_site site);
RETRO_HOOKS_API int64_t retro_fault_failures(enum retro_site site);

// Names of the fault sites (NULL past the end).
RETRO_HOOKS_API const char * retro_site_name(int site);

#ifdef RETRO_WITHOUT_SEEDED_DEFECTS
// A release build (RETRO_SEEDED_DEFECTS=OFF): every seeded-defect switch is the constant false, so
// the compiler drops the code each one guards, and the switches themselves are not built.
#define retro_defect_on(defect) ((void) (defect), false)
#else
// The seeded defects' IDs (NULL past the end), and their switches: true while one is switched on.
RETRO_HOOKS_API const char * retro_defect_clause(int defect);
RETRO_HOOKS_API bool retro_defect_on(enum retro_defect defect);
RETRO_HOOKS_API void retro_defect_set(enum retro_defect defect, bool on);
#endif

// How the CPU backend computes F32 and F16 x F32 products (MUL_MAT and OUT_PROD, forward and
// backward): as upstream, or as CUDA does on an H100/H200 (fork patch 0055: by the product's row
// count, TF32 inputs where its tensor-core kernel runs, truncated or rounded to nearest; the F32 side
// against F16 in F16; each dot product summed in 32 strided lanes reduced by halves, as a warp does),
// so that the suite's bounds can be proved against GPU numerics on a machine without a GPU (an RPC
// server's CPU, certified with `--numerics gpu-like`). Process-wide; a release build computes as
// upstream only.
enum retro_numerics { RETRO_NUMERICS_CPU = 0, RETRO_NUMERICS_GPU_LIKE = 1, RETRO_NUMERICS_GPU_LIKE_NEAREST = 2 };
#ifdef RETRO_WITHOUT_SEEDED_DEFECTS
#define retro_numerics() RETRO_NUMERICS_CPU
#else
RETRO_HOOKS_API enum retro_numerics retro_numerics(void);
RETRO_HOOKS_API void retro_numerics_set(enum retro_numerics numerics);
#endif

#ifdef __cplusplus
}
#endif
