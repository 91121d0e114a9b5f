// The seeded-defect switches (fault_injection/native/retro-defects.def), read once per native call
// into a snapshot so that the loop tests plain bools: nothing to pay while every switch is off.
#pragma once

#include "retro-hooks.h"

namespace retro {

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

}  // namespace retro
