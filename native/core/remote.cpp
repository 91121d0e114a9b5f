#include "remote.h"

#include "errors.h"
#include "ggml-backend.h"
#include "retro-hooks.h"

#include <cstring>
#include <mutex>
#include <set>

#if defined(RETRO_WITH_RPC)
#include "ggml-rpc.h"
#endif

namespace retro {

bool rpc_built() {
#if defined(RETRO_WITH_RPC)
    return true;
#else
    return false;
#endif
}

#if defined(RETRO_WITH_RPC)
int32_t rpc_connect(const std::string & endpoint) {
    static std::mutex mutex;
    static std::set<std::string> registered;  // ggml lists a registry as often as it is registered
    std::lock_guard<std::mutex> lock(mutex);
    ggml_backend_reg_t reg = ggml_backend_rpc_add_server(endpoint.c_str());
    if (!reg) {
        return 0;
    }
    bool listed = !registered.insert(endpoint).second;
    if (retro_defect_on(RETRO_DEFECT_HARNESS_01_ONE_SERVER)) {
        // seeded defect HARNESS-01.one-server: registered only while no RPC registry is listed,
        // as if every server shared one registry
        for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
            listed = listed || std::strncmp(ggml_backend_reg_name(ggml_backend_reg_get(i)), "RPC", 3) == 0;
        }
    }
    if (!listed) {
        ggml_backend_register(reg);
    }
    return (int32_t) ggml_backend_reg_dev_count(reg);
}

void rpc_set_timeout_ms(uint32_t ms) {
    ggml_backend_rpc_set_timeout_ms(ms);
}

void rpc_serve(const std::string & endpoint, int32_t n_threads) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) {
        throw Error(ErrorKind::Backend, "no CPU device to serve");
    }
    ggml_backend_rpc_start_server(endpoint.c_str(), nullptr, (size_t) n_threads, 1, &cpu);
    throw Error(ErrorKind::Backend, "the RPC server could not start on " + endpoint);
}
#else
int32_t rpc_connect(const std::string &) {
    throw Error(ErrorKind::Backend, "this build has no RPC backend (RETRO_RPC=OFF)");
}

void rpc_set_timeout_ms(uint32_t) {}

void rpc_serve(const std::string &, int32_t) {
    throw Error(ErrorKind::Backend, "this build has no RPC backend (RETRO_RPC=OFF)");
}
#endif

}  // namespace retro
