// The ipc executor's hot loop in native code: one rank's shared-slot messages of one update,
// replayed with the GIL released and no Python between messages.
//
// Why: over shared memory a message costs one copy per side and a few stores, so what is left
// around the copies is per-message overhead, and with more processes than cores that overhead
// grows: every wake-up returns to an interpreter whose code and data the last 4 MiB copy pushed
// out of the caches. Here a message is: wait on this rank's doorbell for the slot (sender) or
// the chunk (receiver), copy with prebuilt boxes, store the control words, ring the peer.
//
// The protocol is the one awex_fast/transport/ipc.py documents and implements for plain
// isend/irecv (slot control line: [0] ready, [1] nbytes, [2] tag, [3] consumed, [4] total), and
// each wait behaves like IpcTransferGroup.wait_for: bounded by its timeout, waking at least every
// `slice_s` to check that the peer lives and has not aborted, and that this group is not closed.
// A failure is returned, not thrown, so that Python can name the message, bucket and version.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "common.h"
#include "copy/checksum.h"
#include "copy/copy.h"
#include "shm/sync.h"

namespace py = pybind11;

namespace awex::shm {
namespace {

double now_s() {  // CLOCK_MONOTONIC, the clock of Python's time.perf_counter on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// True while `pid` runs; a zombie (killed, not yet reaped) counts as dead, as in ipc.py.
bool pid_alive(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) return errno != ENOENT && errno != ESRCH;  // cannot tell: the timeout decides
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return false;
  return close[2] != 'Z' && close[2] != 'X';
}

enum Status : int { kOk = 0, kTimeout = 1, kAborted = 2, kDead = 3, kClosed = 4, kMismatch = 5 };

constexpr int kReady = 0, kNbytes = 1, kTag = 2, kConsumed = 3, kTotal = 4;

struct Peer {
  int64_t rank, pid;
  uintptr_t bell;                   // its doorbell
  std::vector<uintptr_t> aborted;   // the abort word of every channel shared with it
};

struct Step {
  int peer;        // index into peers
  uintptr_t ctl;   // the slot's control line
  uintptr_t slot;  // the slot's first byte
  int64_t tag, nbytes;
  std::vector<copy::Box> boxes;
};

struct Failure {
  int status = kOk;
  std::string detail;
};

class Runner {
 public:
  Runner(const std::string& role, int64_t rank, const py::list& peers, const py::list& steps,
         uintptr_t own_bell, uintptr_t closed_word, double slice_s)
      : send_(role == "send"), rank_(rank), own_bell_(own_bell), closed_(closed_word), slice_s_(slice_s) {
    AWEX_CHECK_ARG(role == "send" || role == "recv", "role must be 'send' or 'recv', got '", role, "'");
    AWEX_CHECK_ARG(slice_s > 0, "slice_s must be positive");
    for (const auto& item : peers) {
      auto t = item.cast<py::tuple>();
      peers_.push_back({t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<uintptr_t>(),
                        t[3].cast<std::vector<uintptr_t>>()});
    }
    for (const auto& item : steps) {
      auto t = item.cast<py::tuple>();
      Step s;
      s.peer = t[0].cast<int>();
      s.ctl = t[1].cast<uintptr_t>();
      s.slot = t[2].cast<uintptr_t>();
      s.tag = t[3].cast<int64_t>();
      s.nbytes = t[4].cast<int64_t>();
      AWEX_CHECK_ARG(s.peer >= 0 && s.peer < static_cast<int>(peers_.size()), "step peer index ", s.peer,
                     " out of range");
      AWEX_CHECK_ARG(s.ctl % 64 == 0 && s.ctl != 0, "slot control line must be 64-byte aligned");
      auto desc = t[5].cast<py::array_t<int64_t, py::array::c_style | py::array::forcecast>>();
      AWEX_CHECK_ARG(desc.ndim() == 2 && desc.shape(1) == copy::kDescWords, "descriptors must have shape [n, ",
                     copy::kDescWords, "]");
      s.boxes = copy::normalize(desc.data(), desc.shape(0), /*max_unit=*/1);
      steps_.push_back(std::move(s));
    }
  }

  // Runs every step; `bases[p]` is the chunk number of tag 0 of peer index p. Returns
  // (status, failed step or -1, detail, times [steps, 3], checksums).
  py::tuple run(const std::vector<int64_t>& bases, double timeout_s, bool verify) {
    AWEX_CHECK_ARG(bases.size() == peers_.size(), "one chunk base per peer expected");
    AWEX_CHECK_ARG(timeout_s > 0, "timeout_s must be positive");
    py::array_t<double> times({static_cast<py::ssize_t>(steps_.size()), static_cast<py::ssize_t>(3)});
    std::vector<uint64_t> sums(verify ? steps_.size() : 0, 0);
    double* tm = times.mutable_data();
    Failure fail;
    int64_t failed = -1;
    {
      py::gil_scoped_release release;
      for (size_t i = 0; i < steps_.size() && fail.status == kOk; ++i) {
        const Step& s = steps_[i];
        const uint64_t n = static_cast<uint64_t>(bases[s.peer] + s.tag);
        fail = send_ ? send_one(s, n, timeout_s, verify ? &sums[i] : nullptr, tm + 3 * i)
                     : recv_one(s, n, timeout_s, verify ? &sums[i] : nullptr, tm + 3 * i);
        if (fail.status != kOk) failed = static_cast<int64_t>(i);
      }
      if (send_ && fail.status == kOk) failed = drain(bases, timeout_s, fail);
    }
    return py::make_tuple(fail.status, failed, fail.detail, times, sums);
  }

  size_t num_steps() const { return steps_.size(); }

 private:
  // Sleeps on this rank's doorbell until ready() holds (see the file comment).
  template <typename Ready>
  Failure wait(const Ready& ready, const Peer& p, double timeout_s, const std::string& what) const {
    const double deadline = now_s() + timeout_s;
    bool quiet = false;  // the last sleep ran its whole slice: look at the peer
    while (true) {
      const uint32_t seen = bell_read(own_bell_);
      if (ready()) return {};
      if (closed_ != 0 && load(closed_) != 0)
        return {kClosed, concat("ipc transfer group was closed or aborted while waiting for ", what)};
      if (quiet) {
        for (uintptr_t a : p.aborted)
          if (load(a) != 0)
            return {kAborted, concat("ipc: rank ", p.rank, " aborted the transfer while rank ", rank_,
                                     " waited for ", what)};
        if (!pid_alive(p.pid))
          return {kDead, concat("ipc: rank ", p.rank, " (pid ", p.pid, ") died while rank ", rank_,
                                " waited for ", what)};
      }
      const double left = deadline - now_s();
      if (left <= 0) {
        char secs[32];
        std::snprintf(secs, sizeof(secs), "%.1f", timeout_s);
        return {kTimeout, concat("ipc: waiting for ", what, " from rank ", p.rank, " timed out after ", secs, "s")};
      }
      quiet = !futex_sleep(own_bell_, seen, std::min(slice_s_, left));
    }
  }

  static uint64_t ctl(const Step& s, int field) { return load(s.ctl + 8 * field); }

  Failure send_one(const Step& s, uint64_t n, double timeout_s, uint64_t* sum, double* t) const {
    const Peer& p = peers_[s.peer];
    // the slot is free once the receiver released whatever was published in it last
    Failure f = wait([&] { return ctl(s, kConsumed) >= ctl(s, kReady); }, p, timeout_s,
                     concat("a free slot for chunk ", n));
    if (f.status != kOk) return f;
    t[0] = now_s();
    copy::copy_cpu(s.boxes, /*streaming=*/false);  // the receiver reads the slot next
    if (sum != nullptr) *sum = copy::checksum_cpu(reinterpret_cast<const void*>(s.slot), s.nbytes);
    t[1] = t[2] = now_s();
    store(s.ctl + 8 * kNbytes, static_cast<uint64_t>(s.nbytes));
    store(s.ctl + 8 * kTag, static_cast<uint64_t>(s.tag));
    store(s.ctl + 8 * kTotal, 0);
    store(s.ctl + 8 * kReady, n + 1);  // release: the bytes and the words above are visible
    bell_ring(p.bell);
    return {};
  }

  Failure recv_one(const Step& s, uint64_t n, double timeout_s, uint64_t* sum, double* t) const {
    const Peer& p = peers_[s.peer];
    t[0] = now_s();
    Failure f = wait([&] { return ctl(s, kReady) >= n + 1; }, p, timeout_s, concat("chunk ", n));
    if (f.status != kOk) return f;
    t[1] = now_s();
    const uint64_t got_bytes = ctl(s, kNbytes), got_tag = ctl(s, kTag);
    if (got_tag != static_cast<uint64_t>(s.tag) || got_bytes != static_cast<uint64_t>(s.nbytes))
      return {kMismatch, concat("rank ", rank_, " expected message ", s.tag, " of ", s.nbytes,
                                " bytes but its peer published message ", static_cast<int64_t>(got_tag), " of ",
                                got_bytes, " bytes")};
    if (sum != nullptr) *sum = copy::checksum_cpu(reinterpret_cast<const void*>(s.slot), s.nbytes);
    copy::copy_cpu(s.boxes, /*streaming=*/true);  // weights: not read again soon
    store(s.ctl + 8 * kConsumed, n + 1);
    bell_ring(p.bell);
    t[2] = now_s();
    return {};
  }

  // Sender: wait until each peer read its last message, so a receiver that dies now still fails
  // the update. Returns the step index blamed on failure (that peer's last step).
  int64_t drain(const std::vector<int64_t>& bases, double timeout_s, Failure& fail) const {
    std::map<int, size_t> last;  // peer index -> its step of the highest tag
    for (size_t i = 0; i < steps_.size(); ++i) {
      auto it = last.find(steps_[i].peer);
      if (it == last.end() || steps_[it->second].tag < steps_[i].tag) last[steps_[i].peer] = i;
    }
    for (const auto& [peer, i] : last) {
      const Step& s = steps_[i];
      const uint64_t n = static_cast<uint64_t>(bases[peer] + s.tag);
      fail = wait([&] { return ctl(s, kConsumed) >= n + 1; }, peers_[peer], timeout_s,
                  concat("chunk ", n, " to be read"));
      if (fail.status != kOk) return static_cast<int64_t>(i);
    }
    return -1;
  }

  bool send_;
  int64_t rank_;
  uintptr_t own_bell_, closed_;
  double slice_s_;
  std::vector<Peer> peers_;
  std::vector<Step> steps_;
};

}  // namespace

void register_runner(py::module_& shm) {
  py::class_<Runner>(shm, "Runner",
                     "One rank's shared-slot messages of an update, replayed natively (csrc/shm/runner.cpp).")
      .def(py::init<const std::string&, int64_t, const py::list&, const py::list&, uintptr_t, uintptr_t, double>(),
           py::arg("role"), py::arg("rank"), py::arg("peers"), py::arg("steps"), py::arg("own_bell"),
           py::arg("closed_word"), py::arg("slice_s"),
           "peers: (rank, pid, bell address, [abort word addresses]); steps, in execution order: "
           "(peer index, slot control address, slot address, tag, nbytes, int64 descriptors [n, DESC_WORDS]).")
      .def("run", &Runner::run, py::arg("bases"), py::arg("timeout_s"), py::arg("verify") = false,
           "Run every step; returns (status, failed step or -1, detail, times [steps, 3], checksums). "
           "status: 0 ok, 1 timeout, 2 peer aborted, 3 peer died, 4 group closed, 5 message mismatch.")
      .def_property_readonly("num_steps", &Runner::num_steps);
}

}  // namespace awex::shm
