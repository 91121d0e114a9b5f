// ggml's RPC backend: a device served by another process over TCP. A server here is a real
// remote device (its own buffers and transport); the harness starts and kills it.
#pragma once

#include <cstdint>
#include <string>

namespace retro {

bool rpc_built();
// Register the devices of the server at host:port with ggml (once per endpoint); the number of
// its devices, 0 when it cannot be reached.
int32_t rpc_connect(const std::string & endpoint);
// Deadline of each send and receive on connections made from now on (0: none).
void rpc_set_timeout_ms(uint32_t ms);
// Serve this process's CPU on host:port until the process ends (blocks; returns only when the
// server could not start).
void rpc_serve(const std::string & endpoint, int32_t n_threads);

}  // namespace retro
