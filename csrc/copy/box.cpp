// Descriptor parsing, validation, dimension coalescing and the destination-overlap check.
#include <algorithm>
#include <numeric>

#include "common.h"
#include "copy/copy.h"

namespace awex::copy {
namespace {

// Merge adjacent dims that are contiguous with each other on both sides, drop size-1 dims.
// Keeps innermost last. Returns the new ndim (at least 1).
int coalesce(int ndim, int64_t* shape, int64_t* s_str, int64_t* d_str) {
  int out = 0;
  int64_t sh[kMaxDims], ss[kMaxDims], ds[kMaxDims];
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] == 1) continue;
    if (out > 0 && ss[out - 1] == s_str[i] * shape[i] && ds[out - 1] == d_str[i] * shape[i]) {
      sh[out - 1] *= shape[i];
      ss[out - 1] = s_str[i];
      ds[out - 1] = d_str[i];
      continue;
    }
    sh[out] = shape[i];
    ss[out] = s_str[i];
    ds[out] = d_str[i];
    ++out;
  }
  if (out == 0) {
    sh[0] = 1;
    ss[0] = 1;
    ds[0] = 1;
    out = 1;
  }
  for (int i = 0; i < out; ++i) {
    shape[i] = sh[i];
    s_str[i] = ss[i];
    d_str[i] = ds[i];
  }
  return out;
}

// Sufficient condition for a box not to overlap itself, true for every view torch's slicing,
// stepping and transposing produce: sorted by stride, each stride is at least the span of the
// dims below it.
bool strides_nest(const int64_t* row) {
  const int ndim = static_cast<int>(row[2]);
  std::pair<int64_t, int64_t> dims[kMaxDims];
  int m = 0;
  for (int d = 0; d < ndim; ++d)
    if (row[kShapeAt + d] > 1) dims[m++] = {row[kDstStrideAt + d], row[kShapeAt + d]};
  std::sort(dims, dims + m);
  int64_t span = 1;
  for (int d = 0; d < m; ++d) {
    if (dims[d].first < span) return false;
    span = dims[d].first * dims[d].second;
  }
  return true;
}

bool aligned(const void* p, int64_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Widen a bitwise copy to a larger access unit while the innermost dim stays contiguous and
// every address and stride stays aligned to the doubled unit.
void widen(Box& b, int max_unit) {
  const int last = b.ndim - 1;
  while (b.src_size * 2 <= max_unit && b.src_stride[last] == 1 && b.dst_stride[last] == 1 &&
         b.shape[last] % 2 == 0) {
    const int64_t next = b.src_size * 2;
    if (!aligned(b.src, next) || !aligned(b.dst, next)) break;
    bool ok = true;
    for (int i = 0; i < last; ++i) ok = ok && b.src_stride[i] % 2 == 0 && b.dst_stride[i] % 2 == 0;
    if (!ok) break;
    for (int i = 0; i < last; ++i) {
      b.src_stride[i] /= 2;
      b.dst_stride[i] /= 2;
    }
    b.shape[last] /= 2;
    b.numel /= 2;
    b.src_size = b.dst_size = static_cast<int>(next);
  }
}

}  // namespace

std::vector<Box> normalize(const int64_t* desc, int64_t n, int max_unit) {
  std::vector<Box> boxes;
  boxes.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* row = desc + i * kDescWords;
    Box b{};
    b.src = reinterpret_cast<const char*>(row[0]);
    b.dst = reinterpret_cast<char*>(row[1]);
    const int ndim = static_cast<int>(row[2]);
    AWEX_CHECK_ARG(ndim >= 0 && ndim <= kMaxDims, "box ", i, ": ndim ", ndim, " outside [0, ",
                   kMaxDims, "]");
    const int64_t scode = row[3], dcode = row[4];
    b.src_size = code_size(scode);
    b.dst_size = code_size(dcode);
    AWEX_CHECK_ARG(b.src_size > 0 && b.dst_size > 0, "box ", i, ": dtype code without itemsize");
    if (scode == dcode) {
      b.src_kind = b.dst_kind = kRaw;
    } else {
      b.src_kind = code_kind(scode);
      b.dst_kind = code_kind(dcode);
      AWEX_CHECK_ARG(is_float_kind(b.src_kind) && is_float_kind(b.dst_kind), "box ", i,
                     ": cannot cast between dtype codes ", scode, " and ", dcode,
                     " (casts are among float32, bfloat16 and float16)");
    }
    int64_t numel = 1;
    for (int d = 0; d < ndim; ++d) {
      b.shape[d] = row[kShapeAt + d];
      b.src_stride[d] = row[kSrcStrideAt + d];
      b.dst_stride[d] = row[kDstStrideAt + d];
      AWEX_CHECK_ARG(b.shape[d] >= 0, "box ", i, ": negative size in dim ", d);
      AWEX_CHECK_ARG(b.src_stride[d] >= 0 && b.dst_stride[d] >= 0, "box ", i,
                     ": negative stride in dim ", d);
      numel *= b.shape[d];
    }
    if (numel == 0) continue;  // nothing to copy; empty boxes are legal
    AWEX_CHECK_ARG(b.src != nullptr && b.dst != nullptr, "box ", i, ": null pointer with ", numel,
                   " elements");
    b.ndim = coalesce(ndim, b.shape, b.src_stride, b.dst_stride);
    b.numel = numel;
    if (b.src_kind == kRaw) widen(b, max_unit);
    boxes.push_back(b);
  }
  return boxes;
}

namespace {

// The byte interval one destination box spans (first to last byte, not every byte).
struct Span {
  uintptr_t lo, hi;
  int64_t box;
};

// A contiguous byte interval of one box's destination.
struct Run {
  uintptr_t lo, hi;
  int64_t box;
};

// Spans of the non-empty boxes, sorted by start; returns the index of a box whose destination
// broadcasts (a stride-0 dim of size > 1: it overlaps itself), or -1.
int64_t dst_spans(const int64_t* desc, int64_t n, std::vector<Span>& spans) {
  spans.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* row = desc + i * kDescWords;
    const int ndim = static_cast<int>(row[2]);
    const int64_t size = code_size(row[4]);
    uintptr_t extent = static_cast<uintptr_t>(size);
    bool empty = false;
    for (int d = 0; d < ndim; ++d) empty = empty || row[kShapeAt + d] == 0;
    if (empty) continue;
    for (int d = 0; d < ndim; ++d) {
      const int64_t sh = row[kShapeAt + d];
      if (sh > 1 && row[kDstStrideAt + d] == 0) return i;  // broadcast destination
      extent += static_cast<uintptr_t>((sh - 1) * row[kDstStrideAt + d] * size);
    }
    const auto lo = static_cast<uintptr_t>(row[1]);
    spans.push_back({lo, lo + extent, i});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.lo < b.lo || (a.lo == b.lo && a.box < b.box); });
  return -1;
}

// Appends the runs of box ``i``: contiguous byte intervals of its destination, found by walking
// the outer dims with an odometer (the innermost dim is one run when its stride is 1).
void append_dst_runs(const int64_t* desc, int64_t i, std::vector<Run>& out) {
  const int64_t* row = desc + i * kDescWords;
  int64_t shape[kMaxDims], st[kMaxDims], dummy[kMaxDims];
  int ndim = static_cast<int>(row[2]);
  for (int d = 0; d < ndim; ++d) {
    shape[d] = row[kShapeAt + d];
    st[d] = row[kDstStrideAt + d];
    dummy[d] = st[d];
  }
  ndim = coalesce(ndim, shape, st, dummy);
  const int64_t size = code_size(row[4]);
  const bool inner_run = st[ndim - 1] == 1;
  const int outer = inner_run ? ndim - 1 : ndim;
  const uintptr_t run_bytes = inner_run ? static_cast<uintptr_t>(shape[ndim - 1] * size) : size;
  int64_t idx[kMaxDims] = {0};
  const auto base = static_cast<uintptr_t>(row[1]);
  while (true) {
    int64_t off = 0;
    for (int d = 0; d < outer; ++d) off += idx[d] * st[d];
    const uintptr_t lo = base + static_cast<uintptr_t>(off * size);
    out.push_back({lo, lo + run_bytes, i});
    AWEX_CHECK_ARG(out.size() < (size_t{1} << 26), "destination boxes too fragmented to verify "
                                                    "that they do not overlap (over 2^26 runs)");
    int d = outer - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
    if (d < 0) break;
  }
}

// Sorts ``runs`` and returns the (lower, higher) box indices of the first two that overlap, or
// {-1, -1}.
std::pair<int64_t, int64_t> first_run_overlap(std::vector<Run>& runs) {
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.lo < b.lo; });
  uintptr_t max_hi = runs[0].hi;
  int64_t owner = runs[0].box;
  for (size_t r = 1; r < runs.size(); ++r) {
    if (runs[r].lo < max_hi) return {std::min(owner, runs[r].box), std::max(owner, runs[r].box)};
    if (runs[r].hi > max_hi) {
      max_hi = runs[r].hi;
      owner = runs[r].box;
    }
  }
  return {-1, -1};
}

}  // namespace

std::pair<int64_t, int64_t> find_dst_overlap(const int64_t* desc, int64_t n) {
  std::vector<Span> spans;
  const int64_t broadcast = dst_spans(desc, n, spans);
  if (broadcast >= 0) return {broadcast, broadcast};
  // Sweep clusters of boxes whose spans meet; only those need the run-level check.
  size_t k = 0;
  std::vector<Run> runs;
  while (k < spans.size()) {
    size_t end = k + 1;
    uintptr_t hi = spans[k].hi;
    while (end < spans.size() && spans[end].lo < hi) hi = std::max(hi, spans[end++].hi);
    // A single box can still overlap itself through its strides (as_strided views); only boxes
    // whose strides do not nest need the run-level check.
    if (end - k > 1 || !strides_nest(desc + spans[k].box * kDescWords)) {
      runs.clear();
      for (size_t m = k; m < end; ++m) append_dst_runs(desc, spans[m].box, runs);
      const auto hit = first_run_overlap(runs);
      if (hit.first >= 0) return hit;
    }
    k = end;
  }
  return {-1, -1};
}

}  // namespace awex::copy
