// CPU twin of the CUDA copy kernel: the same normalised boxes, copied by the shared thread pool.
//
// Work is split by bytes: the boxes are laid end to end in "byte space", cut into ~1 MiB slices
// that the pool's threads claim dynamically (so a descheduled thread holds nothing up), and a
// slice boundary may fall inside a box (the box is then resumed mid-row by the next slice).
// Contiguous innermost runs of bitwise copies are one memcpy each, or, when long, a copy with
// software prefetch (and non-temporal stores into destinations marked streaming).
#include <algorithm>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common.h"
#include "copy/copy.h"
#include "copy/thread_pool.h"

namespace awex::copy {
namespace {

// Work is cut into slices of about this many bytes, claimed dynamically by the pool's threads.
constexpr int64_t kSliceBytes = 1 << 20;
constexpr int64_t kMaxSlices = 4096;

template <typename T>
void strided_raw(const char* s, char* d, int64_t n, int64_t ss, int64_t ds) {
  const T* sp = reinterpret_cast<const T*>(s);
  T* dp = reinterpret_cast<T*>(d);
  for (int64_t i = 0; i < n; ++i) memcpy(dp + i * ds, sp + i * ss, sizeof(T));
}

struct Bytes16 {
  uint64_t lo, hi;
};

// One core's demand misses alone do not reach its share of memory bandwidth (measured here:
// a cold-source copy gains ~20 %, the fp32 -> bf16 cast ~15 %, from prefetching this far ahead
// into L2). Prefetching past the end of a buffer is harmless: prefetches never fault.
constexpr int64_t kPrefetchBytes = 4096;
// Contiguous runs at least this long take the prefetching / streaming copies below.
constexpr int64_t kLongRunBytes = 16 * 1024;

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, /*rw=*/0, /*locality=*/2); }

// memcpy in 4 KiB blocks, each preceded by prefetches of the block kPrefetchBytes further on.
void copy_prefetched(const char* s, char* d, int64_t n) {
  constexpr int64_t kBlock = 4096;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t k = 0; k < kBlock; k += 64) prefetch_l2(s + i + kPrefetchBytes + k);
    memcpy(d + i, s + i, kBlock);
  }
  memcpy(d + i, s + i, static_cast<size_t>(n - i));
}

// Copy for destinations nobody reads soon (received weights): non-temporal stores skip the
// read-for-ownership of every destination line and leave the caches to the data that will be
// read (measured here: 1.5-1.9x memcpy's rate into cold memory). SSE2 is the x86-64 baseline,
// and 16-byte streaming stores already saturate a core's write path.
void copy_streaming(const char* s, char* d, int64_t n) {
#if defined(__SSE2__)
  const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
  memcpy(d, s, static_cast<size_t>(head));
  int64_t i = head;
  for (; i + 256 <= n; i += 256) {
    for (int k = 0; k < 256; k += 64) prefetch_l2(s + i + 2 * kPrefetchBytes + k);
    for (int k = 0; k < 256; k += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + k), v);
    }
  }
  memcpy(d + i, s + i, static_cast<size_t>(n - i));
  // Streaming stores are weakly ordered: fence before the pool reports this slice done, so a
  // peer told "copied" never reads stale lines.
  _mm_sfence();
#else
  copy_prefetched(s, d, n);
#endif
}

void run_raw(const Box& b, const char* s, char* d, int64_t n, int64_t ss, int64_t ds, bool streaming) {
  if (ss == 1 && ds == 1) {
    const int64_t bytes = n * b.src_size;
    if (bytes < kLongRunBytes) memcpy(d, s, static_cast<size_t>(bytes));
    else if (streaming) copy_streaming(s, d, bytes);
    else copy_prefetched(s, d, bytes);
    return;
  }
  switch (b.src_size) {
    case 1: return strided_raw<uint8_t>(s, d, n, ss, ds);
    case 2: return strided_raw<uint16_t>(s, d, n, ss, ds);
    case 4: return strided_raw<uint32_t>(s, d, n, ss, ds);
    case 8: return strided_raw<uint64_t>(s, d, n, ss, ds);
    case 16: return strided_raw<Bytes16>(s, d, n, ss, ds);
    default:
      for (int64_t i = 0; i < n; ++i)
        memcpy(d + i * ds * b.dst_size, s + i * ss * b.src_size, static_cast<size_t>(b.src_size));
  }
}

// The two contiguous casts of the RL hot path, written branch-free so the compiler vectorises
// them, and cloned for AVX-512 / AVX2 with a run-time pick (AWEX_CPU_CLONES; the wheel's
// baseline is SSE2, where the f32 -> bf16 loop reaches half of memory bandwidth). Plain integer
// arithmetic, not VCVTNEPS2BF16: that instruction flushes denormals, torch's cast does not.
// Blocks of 64 elements, each preceded (when `prefetch`) by a prefetch kPrefetchBytes ahead of
// the source; a short row of a strided box passes false, since its walker prefetches instead.
inline uint16_t bf16_bits_rne(uint32_t u) { return f32_to_bf16(f32_from_bits(u)); }

AWEX_CPU_CLONES
void f32_to_bf16_contig(const uint32_t* __restrict sp, uint16_t* __restrict dp, int64_t n, bool prefetch) {
  constexpr int64_t kBlock = 64, kAhead = kPrefetchBytes / 4;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    if (prefetch)
      for (int64_t k = 0; k < kBlock; k += 16) prefetch_l2(sp + i + kAhead + k);
    for (int64_t j = 0; j < kBlock; ++j) dp[i + j] = bf16_bits_rne(sp[i + j]);
  }
  for (; i < n; ++i) dp[i] = bf16_bits_rne(sp[i]);
}

AWEX_CPU_CLONES
void bf16_to_f32_contig(const uint16_t* __restrict sp, uint32_t* __restrict dp, int64_t n, bool prefetch) {
  constexpr int64_t kBlock = 64, kAhead = kPrefetchBytes / 2;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    if (prefetch)
      for (int64_t k = 0; k < kBlock; k += 32) prefetch_l2(sp + i + kAhead + k);
    for (int64_t j = 0; j < kBlock; ++j) dp[i + j] = static_cast<uint32_t>(sp[i + j]) << 16;
  }
  for (; i < n; ++i) dp[i] = static_cast<uint32_t>(sp[i]) << 16;
}

template <int S, int D>
void cast_run(const char* s, char* d, int64_t n, int64_t ss, int64_t ds, bool prefetch) {
  constexpr int sb = S == kF32 ? 4 : 2, db = D == kF32 ? 4 : 2;
  if constexpr (S == kF32 && D == kBF16) {
    if (ss == 1 && ds == 1) {
      f32_to_bf16_contig(reinterpret_cast<const uint32_t*>(s), reinterpret_cast<uint16_t*>(d), n, prefetch);
      return;
    }
  }
  if constexpr (S == kBF16 && D == kF32) {
    if (ss == 1 && ds == 1) {
      bf16_to_f32_contig(reinterpret_cast<const uint16_t*>(s), reinterpret_cast<uint32_t*>(d), n, prefetch);
      return;
    }
  }
  if (ss == 1 && ds == 1) {
    for (int64_t i = 0; i < n; ++i) store_from_f32<D>(d + i * db, load_as_f32<S>(s + i * sb));
  } else {
    for (int64_t i = 0; i < n; ++i)
      store_from_f32<D>(d + i * ds * db, load_as_f32<S>(s + i * ss * sb));
  }
}

using RunFn = void (*)(const char*, char*, int64_t, int64_t, int64_t, bool);

RunFn cast_fn(int s, int d) {
  static const RunFn table[4][4] = {
      {nullptr, nullptr, nullptr, nullptr},
      {nullptr, cast_run<kF32, kF32>, cast_run<kF32, kBF16>, cast_run<kF32, kF16>},
      {nullptr, cast_run<kBF16, kF32>, cast_run<kBF16, kBF16>, cast_run<kBF16, kF16>},
      {nullptr, cast_run<kF16, kF32>, cast_run<kF16, kBF16>, cast_run<kF16, kF16>},
  };
  return table[s][d];
}

// Walks the innermost runs of a box over elements [e, end) in row-major order: each step is one
// row of the innermost dimension, or the part of it inside the range.
class RunWalker {
 public:
  RunWalker(const Box& b, int64_t e0, int64_t e1) : b_(b), last_(b.ndim - 1), e_(e0), end_(e1) {
    int64_t row = e0 / b.shape[last_];
    col_ = e0 % b.shape[last_];
    for (int d = last_ - 1; d >= 0; --d) {
      idx_[d] = row % b.shape[d];
      row /= b.shape[d];
    }
    for (int d = 0; d < last_; ++d) {
      soff_ += idx_[d] * b.src_stride[d];
      doff_ += idx_[d] * b.dst_stride[d];
    }
  }
  bool done() const { return e_ >= end_; }
  int64_t elements() const { return std::min(b_.shape[last_] - col_, end_ - e_); }
  const char* src() const { return b_.src + (soff_ + col_ * b_.src_stride[last_]) * b_.src_size; }
  char* dst() const { return b_.dst + (doff_ + col_ * b_.dst_stride[last_]) * b_.dst_size; }

  void next() {  // past the current run: an odometer over the outer dims
    e_ += elements();
    col_ = 0;
    for (int d = last_ - 1; d >= 0; --d) {
      soff_ += b_.src_stride[d];
      doff_ += b_.dst_stride[d];
      if (++idx_[d] < b_.shape[d]) break;
      soff_ -= idx_[d] * b_.src_stride[d];
      doff_ -= idx_[d] * b_.dst_stride[d];
      idx_[d] = 0;
    }
  }

 private:
  const Box& b_;
  const int last_;
  int64_t idx_[kMaxDims] = {0};
  int64_t soff_ = 0, doff_ = 0, col_ = 0, e_, end_;
};

// Prefetches the source rows of a strided box as one stream, kPrefetchBytes ahead of the row
// being copied and across row ends. Per-row prefetching would run past every short row's end
// into bytes this box never reads (the other receiver's half of a row-parallel weight) and
// would start each row cold.
class RowPrefetcher {
 public:
  RowPrefetcher(const Box& b, int64_t e0, int64_t e1) : ahead_(b, e0, e1), unit_(b.src_size) {}

  // Prefetch the stream up to byte `upto` (counted from the range's first source byte).
  void until(int64_t upto) {
    while (pos_ < upto && !ahead_.done()) {
      const int64_t row = ahead_.elements() * unit_;
      const int64_t take = std::min(row - in_row_, upto - pos_);
      const char* p = ahead_.src() + in_row_;
      for (int64_t k = 0; k < take; k += 64) prefetch_l2(p + k);
      pos_ += take;
      in_row_ += take;
      if (in_row_ == row) {
        ahead_.next();
        in_row_ = 0;
      }
    }
  }

 private:
  RunWalker ahead_;
  const int64_t unit_;
  int64_t pos_ = 0, in_row_ = 0;
};

// Copies elements [e0, e1) of box b (row-major element order over its coalesced shape).
void copy_range(const Box& b, int64_t e0, int64_t e1, bool streaming) {
  const RunFn cast = b.src_kind == kRaw ? nullptr : cast_fn(b.src_kind, b.dst_kind);
  const int last = b.ndim - 1;
  // Short rows (and contiguous ones) of more than one row: the walker prefetches across rows.
  const bool short_rows = b.src_stride[last] == 1 && e1 - e0 > b.shape[last] &&
                          b.shape[last] * b.src_size < kLongRunBytes;
  RowPrefetcher prefetcher(b, e0, e1);
  int64_t pos = 0;  // source bytes copied so far
  for (RunWalker w(b, e0, e1); !w.done(); w.next()) {
    const int64_t n = w.elements();
    if (short_rows) prefetcher.until(pos + n * b.src_size + kPrefetchBytes);
    if (cast) cast(w.src(), w.dst(), n, b.src_stride[last], b.dst_stride[last], !short_rows);
    else run_raw(b, w.src(), w.dst(), n, b.src_stride[last], b.dst_stride[last], streaming);
    pos += n * b.src_size;
  }
}

}  // namespace

void set_num_threads(int n) {
  AWEX_CHECK_ARG(n >= 1, "thread count must be at least 1, got ", n);
  ThreadPool::instance().resize(n);
}

int num_threads() { return ThreadPool::instance().size(); }

void copy_cpu(const std::vector<Box>& boxes, bool streaming) {
  // [num_boxes + 1] byte-space prefix; a box weighs its larger side's bytes.
  std::vector<int64_t> start(boxes.size() + 1, 0);
  for (size_t i = 0; i < boxes.size(); ++i)
    start[i + 1] = start[i] + boxes[i].numel * std::max(boxes[i].src_size, boxes[i].dst_size);
  const int64_t total = start.back();
  if (total == 0) return;
  auto& pool = ThreadPool::instance();
  const int slices = static_cast<int>(
      pool.size() == 1 ? 1 : std::clamp<int64_t>(total / kSliceBytes, 1, kMaxSlices));
  pool.run(slices, [&](int t) {
    const int64_t lo = total * t / slices, hi = total * (t + 1) / slices;
    size_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; i < boxes.size() && start[i] < hi; ++i) {
      const Box& b = boxes[i];
      const int64_t esz = std::max(b.src_size, b.dst_size);
      // Element boundaries are floor((x - start) / esz) for every slice edge x, so adjacent
      // slices agree on where one ends and the next begins.
      const int64_t e0 = std::clamp<int64_t>((lo - start[i]) / esz, 0, b.numel);
      const int64_t e1 = std::clamp<int64_t>((hi - start[i]) / esz, 0, b.numel);
      if (e1 > e0) copy_range(b, e0, e1, streaming);
    }
  });
}

}  // namespace awex::copy
