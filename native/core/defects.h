// The seeded-defect switches (one per defect of conformance/mutants.toml), read once per native call
// into a snapshot so that the loop tests plain bools: nothing to pay while every switch is off.
#pragma once

#include "retro-hooks.h"

namespace retro {

#ifdef RETRO_WITHOUT_SEEDED_DEFECTS
// A release build: every switch is the constant false, and the code it guards is dropped.
struct Defects {
    static Defects current() { return {}; }
    constexpr bool operator()(retro_defect) const { return false; }
};
#else
struct Defects {
    bool on[RETRO_DEFECT_COUNT] = {};

    static Defects current() {
        Defects d;
        for (int i = 0; i < RETRO_DEFECT_COUNT; ++i) {
            d.on[i] = retro_defect_on(static_cast<retro_defect>(i));
        }
        return d;
    }
    bool operator()(retro_defect which) const { return on[which]; }
};
#endif

}  // namespace retro
