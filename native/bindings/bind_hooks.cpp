// retro._native.hooks: fault sites and seeded-defect switches (fault_injection/native/), by name.
#include "bindings.h"
#include "logging.h"
#include "retro-hooks.h"

#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace retro::bindings {
namespace {

retro_site site_of(const std::string & name) {
    for (int i = 0; i < RETRO_SITE_COUNT; ++i) {
        if (name == retro_site_name(i)) {
            return static_cast<retro_site>(i);
        }
    }
    throw py::value_error("unknown fault site '" + name + "'");
}

// the numerics' names (retro.rpc.NUMERICS)
constexpr std::pair<const char *, enum retro_numerics> k_numerics[] = {
        {"cpu", RETRO_NUMERICS_CPU},
        {"gpu-like", RETRO_NUMERICS_GPU_LIKE},
        {"gpu-like-nearest", RETRO_NUMERICS_GPU_LIKE_NEAREST},
};

#ifdef RETRO_WITHOUT_SEEDED_DEFECTS
constexpr bool k_seeded_defects = false;

const char * retro_defect_clause(int) {
    return nullptr;
}

void retro_defect_set(retro_defect, bool) {}

retro_defect defect_of(const std::string & clause) {
    throw py::value_error("no seeded defect for clause '" + clause +
                          "': this build has none (built with RETRO_SEEDED_DEFECTS=OFF)");
}

void mirror_logs(int) {
    throw py::value_error("no log mirror: a test hook, and this build has none (built with RETRO_SEEDED_DEFECTS=OFF)");
}

void retro_numerics_set(retro_numerics numerics) {
    if (numerics != RETRO_NUMERICS_CPU) {
        throw py::value_error(
                "no GPU-like CPU numerics: a test hook, and this build has none (built with "
                "RETRO_SEEDED_DEFECTS=OFF)");
    }
}
#else
constexpr bool k_seeded_defects = true;
using retro::mirror_logs;

retro_defect defect_of(const std::string & clause) {
    for (int i = 0; i < RETRO_DEFECT_COUNT; ++i) {
        if (clause == retro_defect_clause(i)) {
            return static_cast<retro_defect>(i);
        }
    }
    throw py::value_error("no seeded defect for clause '" + clause + "'");
}
#endif

template <typename Name>
std::vector<std::string> names(int count, Name name) {
    std::vector<std::string> out;
    for (int i = 0; i < count; ++i) {
        out.emplace_back(name(i));
    }
    return out;
}

}  // namespace

void bind_hooks(py::module_ & m) {
    auto hooks = m.def_submodule("hooks", "fault sites and seeded-defect switches compiled into the fork");
    hooks.def("sites", []() { return names(RETRO_SITE_COUNT, retro_site_name); });
    // a release build has no switches: no defect to list, each named one refused
    hooks.attr("seeded_defects") = k_seeded_defects;
    hooks.def("defects", []() { return names(k_seeded_defects ? RETRO_DEFECT_COUNT : 0, retro_defect_clause); });
    hooks.def(
            "arm",
            [](const std::string & site, int64_t hit, bool persistent) {
                retro_fault_arm(site_of(site), hit, persistent);
            },
            py::arg("site"), py::arg("hit"), py::arg("persistent"));
    hooks.def(
            "stall",
            [](const std::string & site, int64_t hit, int64_t microseconds) {
                retro_fault_stall(site_of(site), hit, microseconds);
            },
            py::arg("site"), py::arg("hit"), py::arg("microseconds"));
    hooks.def("stalling", &retro_fault_stalling);
    // every native log line, as it is logged, also to this file descriptor (-1: off)
    hooks.def("mirror_logs", &mirror_logs, py::arg("fd"));
    // how the CPU backend computes matrix products, process-wide: "cpu" (upstream's), "gpu-like" (TF32
    // truncated) or "gpu-like-nearest" (TF32 rounded to nearest)
    hooks.def(
            "set_numerics",
            [](const std::string & numerics) {
                for (const auto & [name, value] : k_numerics) {
                    if (numerics == name) {
                        retro_numerics_set(value);
                        return;
                    }
                }
                throw py::value_error("numerics must be 'cpu', 'gpu-like' or 'gpu-like-nearest', got '" + numerics +
                                      "'");
            },
            py::arg("numerics"));
    hooks.def("numerics", []() {
        for (const auto & [name, value] : k_numerics) {
            if (retro_numerics() == value) {
                return name;
            }
        }
        return "cpu";
    });
    hooks.def("reset", &retro_fault_reset);
    hooks.def("hits", [](const std::string & site) { return retro_fault_hits(site_of(site)); }, py::arg("site"));
    hooks.def(
            "failures", [](const std::string & site) { return retro_fault_failures(site_of(site)); }, py::arg("site"));
    hooks.def(
            "defect_on", [](const std::string & clause) { return retro_defect_on(defect_of(clause)); },
            py::arg("clause"));
    hooks.def(
            "set_defect", [](const std::string & clause, bool on) { retro_defect_set(defect_of(clause), on); },
            py::arg("clause"), py::arg("on"));
}

}  // namespace retro::bindings
