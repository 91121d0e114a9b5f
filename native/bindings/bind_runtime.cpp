// Process-wide parts: build information, devices, the native log queue.
#include "bindings.h"
#include "build_info.h"
#include "logging.h"
#include "remote.h"
#include "thread_governor.h"
#include "trainer.h"

#include "ggml-backend.h"

#include <pybind11/stl.h>

namespace py = pybind11;

namespace retro::bindings {
namespace {

const char * device_kind(ggml_backend_dev_t dev) {
    switch (ggml_backend_dev_type(dev)) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:
            return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU:
            return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU:
            return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL:
            return "accel";
        default:
            return "other";
    }
}

py::list devices() {
    py::list out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        out.append(py::dict(py::arg("index") = i, py::arg("name") = ggml_backend_dev_name(dev),
                            py::arg("description") = ggml_backend_dev_description(dev),
                            py::arg("kind")        = device_kind(dev),
                            py::arg("backend") = reg ? ggml_backend_reg_name(reg) : "", py::arg("memory_free") = free,
                            py::arg("memory_total") = total));
    }
    return out;
}

}  // namespace

void bind_runtime(py::module_ & m) {
    m.def("build_info", []() { return std::string(RETRO_BUILD_INFO); });
    // (ggml contexts, backend buffers) alive in the process, counted where ggml makes and frees them
    m.def("live_allocations", []() { return py::make_tuple(ggml_live_contexts(), ggml_backend_live_buffers()); });
    // times any scheduler entered its eval callback's data phase, counted where the fork calls it
    m.def("scheduler_data_phase_entries", []() { return ggml_backend_sched_eval_data_calls(); });
    m.def("calls_in_flight", []() { return InFlight::count().load(); });
    // the thread governor's reading of the runnable tasks that are not this process's threads
    m.def("runnable_elsewhere", &runnable_elsewhere);
    m.def("set_exiting", []() { exiting() = true; });
    // [(buffer type, bytes its live buffers hold)] over every registered device's buffer types
    m.def("live_buffer_bytes", []() { return live_buffer_bytes(); });
    m.def("devices", &devices);
    m.def("drain_logs", &drain_logs);
    m.def("recent_errors", &recent_errors);
    m.def("rpc_built", &rpc_built);
    m.def("rpc_connect", &rpc_connect, py::arg("endpoint"), py::call_guard<WithoutGil>());
    m.def("rpc_set_timeout_ms", &rpc_set_timeout_ms, py::arg("ms"));
    m.def("rpc_serve", &rpc_serve, py::arg("endpoint"), py::arg("n_threads"), py::call_guard<WithoutGil>());
}

}  // namespace retro::bindings
