// Shared words of the ipc backend (csrc/shm/sync.cpp): acquire/release 64-bit words and the
// futex doorbells, for the bindings and the native runner (csrc/shm/runner.cpp).
#pragma once

#include <cstdint>

namespace awex::shm {

uint64_t load(uintptr_t addr);                // acquire-load of a 64-bit shared word
void store(uintptr_t addr, uint64_t value);   // release-store of a 64-bit shared word
uint32_t bell_read(uintptr_t addr);           // a doorbell's count
void bell_ring(uintptr_t addr);               // increment a doorbell and wake its sleepers
// Sleeps (caller's GIL state untouched) until the doorbell no longer reads `seen` or `timeout_s`
// passes; true when it changed or a spurious wake-up happened (callers re-check either way).
bool futex_sleep(uintptr_t addr, uint32_t seen, double timeout_s);

}  // namespace awex::shm
