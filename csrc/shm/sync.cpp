// Cross-process synchronisation words for the `ipc` transfer backend (awex_fast/transport/ipc.py).
//
// Two processes of one host share a POSIX shared-memory segment; its control words are written
// by one side and read by the other. Sequence words are 64-bit, written with release and read
// with acquire semantics, so the bytes a sender copied into a slot are visible to the receiver
// that saw the slot's sequence move (and a slot the receiver released is no longer being read
// when the sender reuses it). Every rank owns one 32-bit *doorbell*: a peer that publishes or
// releases anything for it increments the doorbell and wakes it (shared, not PRIVATE, futex), so
// a waiter sleeps in the kernel instead of spinning: on a host with fewer cores than ranks a
// spinning waiter would steal the core the peer it waits for needs.
#include <linux/futex.h>
#include <pybind11/pybind11.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "shm/sync.h"

namespace py = pybind11;

namespace awex::shm {

static_assert(std::atomic<uint64_t>::is_always_lock_free, "64-bit atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "32-bit atomics must be lock-free");
static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t), "atomic<u64> must be a plain word");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "atomic<u32> must be a plain word");

namespace {
template <typename T>
std::atomic<T>* word(uintptr_t addr) {
  AWEX_CHECK_ARG(addr != 0 && addr % sizeof(T) == 0, "shared word address ", addr, " is null or not ",
                 sizeof(T), "-byte aligned");
  return reinterpret_cast<std::atomic<T>*>(addr);
}

}  // namespace

uint64_t load(uintptr_t addr) { return word<uint64_t>(addr)->load(std::memory_order_acquire); }

void store(uintptr_t addr, uint64_t value) { word<uint64_t>(addr)->store(value, std::memory_order_release); }

uint32_t bell_read(uintptr_t addr) { return word<uint32_t>(addr)->load(std::memory_order_acquire); }

void bell_ring(uintptr_t addr) {
  auto* bell = word<uint32_t>(addr);
  bell->fetch_add(1, std::memory_order_acq_rel);
  // Wake every sleeper: several threads of the owner may wait on one doorbell.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool futex_sleep(uintptr_t addr, uint32_t seen, double timeout_s) {
  auto* bell = word<uint32_t>(addr);
  if (bell->load(std::memory_order_acquire) != seen) return true;
  AWEX_CHECK_ARG(std::isfinite(timeout_s) && timeout_s >= 0, "timeout_s must be finite and >= 0, got ",
                 timeout_s);
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_s);
  ts.tv_nsec = static_cast<long>((timeout_s - static_cast<double>(ts.tv_sec)) * 1e9);
  const long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, seen, &ts, nullptr, 0);
  if (rc == 0) return true;
  if (errno == EAGAIN || errno == EINTR) return true;
  if (errno == ETIMEDOUT) return bell->load(std::memory_order_acquire) != seen;
  throw RuntimeFailure(concat("futex wait failed: ", std::strerror(errno)));
}

namespace {

bool bell_wait(uintptr_t addr, uint32_t seen, double timeout_s) {
  py::gil_scoped_release release;
  return futex_sleep(addr, seen, timeout_s);
}

}  // namespace

void register_runner(py::module_& shm);

void register_apis(py::module_& m) {
  auto sub = m.def_submodule("shm", "Cross-process words of the ipc transfer backend (csrc/shm/sync.cpp)");
  sub.def("load", &load, py::arg("addr"), "Acquire-load of the 64-bit shared word at `addr`.");
  sub.def("store", &store, py::arg("addr"), py::arg("value"), "Release-store of a 64-bit shared word.");
  sub.def("bell_read", &bell_read, py::arg("addr"), "The 32-bit doorbell's current count.");
  sub.def("bell_ring", &bell_ring, py::arg("addr"), "Increment the doorbell and wake its sleepers.");
  sub.def("bell_wait", &bell_wait, py::arg("addr"), py::arg("seen"), py::arg("timeout_s"),
          "Sleep (GIL released) until the doorbell differs from `seen` or the timeout passes; "
          "True when it changed.");
  register_runner(sub);
}

}  // namespace awex::shm
