// Solver internals shared by plan_solve.cpp (per-rank plans) and plan_stats.cpp (world counts):
// for one inference piece (a "query"), which training pieces send which boxes.
//
// solve(p, query):
//   1. holders = every training piece of p that intersects the query (explicit pieces by a scan,
//      rule pieces by chunk arithmetic: only the cells that overlap are visited).
//   2. If every holder covers the whole query, the query is one cell held by all of them;
//      otherwise the query is cut on every holder boundary into a grid of cells, each held by a
//      fixed set of holders (a cell no holder covers is a PlanError).
//   3. Replica balancing, per cell held by m > 1 holders (decided from this parameter's metadata
//      only, so the sender and the receiver agree without talking):
//        E = inference pieces with the query's very box (engines holding it), bytes = cell
//        elements x receiver itemsize, parts = min(m / gcd(E, m), bytes / min_part_bytes);
//        parts < 2: the cell goes whole to holder (h(p) + q + c) mod m;
//        else it is cut into `parts` near-equal slabs along its outermost dim with extent
//        >= parts (or its longest dim), slab k going to holder (h(p) + q * stride + c + k) mod m,
//        stride = parts (parts < m) or m + 1 (parts == m, which rotates the slab sizes).
//      Here q is the query's expanded index: the E replicas of one inference box are adjacent
//      in it, so consecutive receivers continue the round robin where the previous one stopped:
//      E x parts slabs, a multiple of m, give every holder the same number of slabs, and E >= m
//      engines are served by whole queries (fewer ops and peers than splitting every query).
//      h(p) (a hash of the parameter's index; 0 when E x parts is a multiple of m, so that a
//      sender keeps the same peers for every parameter) decorrelates the remainders.
// Ops of a (sender, receiver) pair come out ordered by (parameter, query, cell, slab); buckets
// are filled greedily in that order (see BucketFill), an op larger than bucket_bytes is cut into
// slabs along its outermost dim whose slab of one index still fits.
#pragma once

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "plan/plan.h"
#include "plan/util.h"

namespace awex::plan::detail {

constexpr int64_t kMaxCells = int64_t{1} << 24;

struct Query {
  int64_t index = 0;  // expanded index on the inference side
  int64_t rank = 0;
  int64_t reps = 1;   // inference pieces with this very box (adjacent in index order)
  int64_t off[kMaxDims] = {}, len[kMaxDims] = {}, loc[kMaxDims] = {};
};

// The geometry shared by the replicas of one training box: its global and local offsets and
// its intersection with the query. Holders of one box are contiguous in Scratch::holders.
struct HBox {
  int64_t off[kMaxDims], loc[kMaxDims];
  int64_t lo[kMaxDims], hi[kMaxDims];
  int64_t first = 0, end = 0;  // holders [first, end)
};

struct Holder {
  int64_t index = 0;  // expanded index on the training side
  int64_t rank = 0;
  int64_t box = 0;
};

struct Scratch {
  std::vector<HBox> boxes;
  std::vector<Holder> holders;
  std::vector<int64_t> cuts[kMaxDims];
  std::vector<int64_t> cell_start, cell_list, fill, ids;
  int64_t ncut[kMaxDims] = {};
  int64_t min_part = kMinPartBytes;
  // The geometry (holders, cells) of the last query solved; see same_geometry().
  bool geo_valid = false;
  int64_t geo_p = -1, geo_cells = 0;
  int64_t geo_off[kMaxDims] = {}, geo_len[kMaxDims] = {};
  explicit Scratch(const World& w) : min_part(w.min_part_bytes()) {}
};

// How many explicit pieces of one side share piece i's box (they are adjacent: canonical order).
inline int64_t explicit_reps(const World& w, int s, const SideParam& sp, int64_t i, int nd) {
  const int64_t* x = w.piece(s, sp, i, nd) + 1;
  auto same = [&](int64_t j) {
    const int64_t* y = w.piece(s, sp, j, nd) + 1;
    return std::equal(x, x + 2 * nd, y);
  };
  int64_t lo = i, hi = i + 1;
  while (lo > 0 && same(lo - 1)) --lo;
  while (hi < sp.piece_count && same(hi)) ++hi;
  return hi - lo;
}

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

[[noreturn]] void uncovered(const Param& P, const Query& q, const int64_t* lo, const int64_t* len);

// Calls f(cell, ordinal, off, len) for every non-empty cell of rule R that overlaps the box
// [lo, lo + len) (which must be non-empty), in row-major order.
template <class F>
void for_rule_cells(const Param& P, const Rule& R, const int64_t* lo, const int64_t* len, F&& f) {
  if (R.cells == 0) return;
  int64_t clo[kMaxDims], chi[kMaxDims], idx[kMaxDims];
  for (int a = 0; a < R.nsplit; ++a) {
    const int d = R.dims[a];
    clo[a] = lo[d] / R.step[a];
    chi[a] = std::min(R.nonempty[a], ceil_div(lo[d] + len[d], R.step[a]));
    if (clo[a] >= chi[a]) return;
    idx[a] = clo[a];
  }
  int64_t off[kMaxDims], ext[kMaxDims];
  for (int d = 0; d < P.ndim; ++d) {
    off[d] = 0;
    ext[d] = P.shape[d];
  }
  while (true) {
    int64_t c = 0, o = 0;
    for (int a = 0; a < R.nsplit; ++a) {
      const int d = R.dims[a];
      c = c * R.chunks[a] + idx[a];
      o = o * R.nonempty[a] + idx[a];
      off[d] = idx[a] * R.step[a];
      ext[d] = std::min(P.shape[d], off[d] + R.step[a]) - off[d];
    }
    f(c, o, off, ext);
    int a = R.nsplit - 1;
    for (; a >= 0; --a) {
      if (++idx[a] < chi[a]) break;
      idx[a] = clo[a];
    }
    if (a < 0) return;
  }
}

// Every training piece of parameter p that intersects [lo, lo + len), by expanded index, into
// s.boxes / s.holders.
void gather(const World& w, int64_t p, const int64_t* lo, const int64_t* len, Scratch& s);

// Cuts [lo, lo + len) on every holder boundary; fills s.cuts, s.ncut, and the holders of each
// cell (CSR: s.cell_start / s.cell_list). Returns the number of cells.
int64_t build_grid(const Param& P, const int64_t* lo, const int64_t* len, Scratch& s);

// The replica choice described at the top of this file, for one cell held by ids[0..m).
template <class Sink>
void assign(int64_t p, const Param& P, const Query& q, const int64_t* lo, const int64_t* len,
            int64_t cell, const Scratch& s, const int64_t* ids, int64_t m, Sink& sink) {
  const std::vector<Holder>& H = s.holders;
  const int nd = P.ndim;
  const int64_t isz = P.side[kInfer].itemsize;
  int64_t vol = 1;
  for (int d = 0; d < nd; ++d) vol *= len[d];
  sink.cell(H, ids, m, vol * isz);
  if (m == 1) {
    sink.op(H[ids[0]], s.boxes[H[ids[0]].box], lo, len);
    return;
  }
  // m / gcd(reps, m) slabs per query make the reps receivers of this box give every holder the
  // same number of slabs; fewer if the slabs would fall below min_part.
  int64_t parts = std::min<int64_t>(m / gcd(std::max<int64_t>(q.reps, 1), m), vol * isz / s.min_part);
  int split = -1;
  if (parts >= 2) {
    for (int d = 0; d < nd && split < 0; ++d) {
      if (len[d] >= parts) split = d;
    }
    if (split < 0) {
      split = static_cast<int>(std::max_element(len, len + nd) - len);
      parts = len[split];
    }
  }
  const uint64_t um = static_cast<uint64_t>(m);
  // When the E receivers' slabs divide evenly over the holders, every parameter uses the same
  // rotation: each sender keeps the same few peers. Otherwise h(p) spreads the remainders.
  const bool even = (std::max<int64_t>(q.reps, 1) * std::max<int64_t>(parts, 1)) % m == 0;
  const uint64_t base = even ? 0 : mix64(static_cast<uint64_t>(p)) % um;
  const uint64_t qi = static_cast<uint64_t>(q.index) % um;
  const uint64_t c = static_cast<uint64_t>(cell) % um;
  if (parts < 2) {
    const Holder& h = H[ids[(base + qi + c) % um]];
    sink.op(h, s.boxes[h.box], lo, len);
    return;
  }
  const uint64_t stride = static_cast<uint64_t>(parts < m ? parts : m + 1) % um;
  const uint64_t rot = (base + qi * stride + c) % um;
  int64_t sub_lo[kMaxDims], sub_len[kMaxDims];
  std::copy(lo, lo + nd, sub_lo);
  std::copy(len, len + nd, sub_len);
  const int64_t extent = len[split];
  for (int64_t k = 0; k < parts; ++k) {
    const int64_t a = extent * k / parts, b = extent * (k + 1) / parts;
    sub_lo[split] = lo[split] + a;
    sub_len[split] = b - a;
    const Holder& h = H[ids[(rot + static_cast<uint64_t>(k)) % um]];
    sink.op(h, s.boxes[h.box], sub_lo, sub_len);
  }
}

// Holders and cells depend only on (parameter, query box): replicas of one inference box
// (adjacent in index order) reuse them, and only the replica choice is redone per query.
inline bool same_geometry(const Scratch& s, int64_t p, const Query& q, int nd) {
  if (!s.geo_valid || s.geo_p != p) return false;
  for (int d = 0; d < nd; ++d) {
    if (s.geo_off[d] != q.off[d] || s.geo_len[d] != q.len[d]) return false;
  }
  return true;
}

template <class Sink>
void solve(const World& w, int64_t p, const Query& q, Scratch& s, Sink& sink) {
  const Param& P = w.params()[p];
  const int nd = P.ndim;
  if (!same_geometry(s, p, q, nd)) {
    s.geo_valid = false;
    gather(w, p, q.off, q.len, s);
    if (s.holders.empty()) uncovered(P, q, q.off, q.len);
    bool full = true;
    for (const HBox& b : s.boxes) {
      for (int d = 0; d < nd && full; ++d) full = b.lo[d] == q.off[d] && b.hi[d] == q.off[d] + q.len[d];
      if (!full) break;
    }
    if (full) {
      s.ids.resize(s.holders.size());
      std::iota(s.ids.begin(), s.ids.end(), 0);
      s.geo_cells = 0;
    } else {
      s.geo_cells = build_grid(P, q.off, q.len, s);
      for (int64_t cell = 0; cell < s.geo_cells; ++cell) {
        if (s.cell_start[cell + 1] == s.cell_start[cell]) {
          int64_t lo[kMaxDims], len[kMaxDims], c = cell;
          for (int d = nd - 1; d >= 0; --d) {
            const int64_t i = c % s.ncut[d];
            c /= s.ncut[d];
            lo[d] = s.cuts[d][i];
            len[d] = s.cuts[d][i + 1] - lo[d];
          }
          uncovered(P, q, lo, len);
        }
      }
    }
    s.geo_valid = true;
    s.geo_p = p;
    std::copy(q.off, q.off + nd, s.geo_off);
    std::copy(q.len, q.len + nd, s.geo_len);
  }
  if (s.geo_cells == 0) {  // every holder covers the whole query
    assign(p, P, q, q.off, q.len, 0, s, s.ids.data(), static_cast<int64_t>(s.holders.size()), sink);
    return;
  }
  int64_t idx[kMaxDims] = {}, lo[kMaxDims], len[kMaxDims];
  for (int64_t cell = 0; cell < s.geo_cells; ++cell) {
    for (int d = 0; d < nd; ++d) {
      lo[d] = s.cuts[d][idx[d]];
      len[d] = s.cuts[d][idx[d] + 1] - lo[d];
    }
    const int64_t m = s.cell_start[cell + 1] - s.cell_start[cell];
    assign(p, P, q, lo, len, cell, s, &s.cell_list[s.cell_start[cell]], m, sink);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < s.ncut[d]) break;
      idx[d] = 0;
    }
  }
}

// q as explicit piece i of side s (row r): its index, rank, replica count and box.
inline void load_piece(const World& w, int s, const SideParam& sp, int64_t i, const int64_t* r, int nd,
                       Query& q) {
  q.index = i;
  q.rank = r[0];
  q.reps = explicit_reps(w, s, sp, i, nd);
  std::copy(r + 1, r + 1 + nd, q.off);
  std::copy(r + 1 + nd, r + 1 + 2 * nd, q.len);
  std::copy(r + 1 + 2 * nd, r + 1 + 3 * nd, q.loc);
}

// f(q) for every inference piece that rule R makes in its cells meeting the box (lo, len),
// replicas of one cell in expanded-index order.
template <class F>
void for_rule_queries(const World& w, const Param& P, const Rule& R, const int64_t* lo, const int64_t* len,
                      Query& q, F&& f) {
  const int nd = P.ndim;
  for_rule_cells(P, R, lo, len, [&](int64_t c, int64_t o, const int64_t* off, const int64_t* ext) {
    std::copy(off, off + nd, q.off);
    std::copy(ext, ext + nd, q.len);
    for (int d = 0; d < nd; ++d) q.loc[d] = R.has_loc ? R.loc[d] : 0;
    q.reps = R.replicas;
    for (int64_t j = 0; j < R.replicas; ++j) {
      q.index = R.piece_base + o * R.replicas + j;
      q.rank = w.pool(kInfer, R.ranks_begin + j * R.total + c);
      f(q);
    }
  });
}

// Every inference piece of p, in expanded-index order.
template <class F>
void for_each_query(const World& w, int64_t p, Query& q, F&& f) {
  const Param& P = w.params()[p];
  const SideParam& sp = P.side[kInfer];
  const int nd = P.ndim;
  for (int64_t i = 0; i < sp.piece_count; ++i) {
    load_piece(w, kInfer, sp, i, w.piece(kInfer, sp, i, nd), nd, q);
    f(q);
  }
  int64_t zero[kMaxDims] = {};
  for (int64_t k = 0; k < sp.rule_count; ++k)
    for_rule_queries(w, P, w.rule(kInfer, P, sp.rule_begin + k), zero, P.shape, q, f);
}

// Greedy bucket filling for one (sender, receiver) pair.
struct BucketFill {
  int64_t fill = 0;
  int64_t count = 0;  // buckets opened so far
  bool open = false;
  // Places nb bytes; returns the op's byte offset and sets `fresh` if a new bucket was opened.
  int64_t place(int64_t nb, int64_t bucket_bytes, bool& fresh) {
    int64_t off = (fill + kOpAlign - 1) / kOpAlign * kOpAlign;
    fresh = !open || off + nb > bucket_bytes;
    if (fresh) {
      open = true;
      ++count;
      off = 0;
    }
    fill = off + nb;
    return off;
  }
};

// Calls f(delta_off, sub_len) for the slabs of an op box `len` so that each fits bucket_bytes.
template <class F>
void split_for_buckets(const int64_t* len, int nd, int64_t isz, int64_t bucket_bytes, F&& f) {
  int64_t inner[kMaxDims + 1];
  inner[nd] = isz;
  for (int d = nd - 1; d >= 0; --d) inner[d] = inner[d + 1] * len[d];
  int64_t delta[kMaxDims] = {}, sub[kMaxDims];
  std::copy(len, len + nd, sub);
  if (inner[0] <= bucket_bytes) {
    f(delta, sub);
    return;
  }
  int d = 0;
  while (inner[d + 1] > bucket_bytes) ++d;  // inner[nd] = isz <= bucket_bytes
  const int64_t rows = bucket_bytes / inner[d + 1];
  for (int a = 0; a < d; ++a) sub[a] = 1;
  int64_t idx[kMaxDims] = {};
  while (true) {
    for (int a = 0; a < d; ++a) delta[a] = idx[a];
    for (int64_t t = 0; t < len[d]; t += rows) {
      delta[d] = t;
      sub[d] = std::min(rows, len[d] - t);
      f(delta, sub);
    }
    int a = d - 1;
    for (; a >= 0; --a) {
      if (++idx[a] < len[a]) break;
      idx[a] = 0;
    }
    if (a < 0) return;
  }
}

struct NullSink {
  void cell(const std::vector<Holder>&, const int64_t*, int64_t, int64_t) {}
  void op(const Holder&, const HBox&, const int64_t*, const int64_t*) {}
};

// Positions of one rank in each distinct rule's rank list, per side: CSR over rule defs.
struct Positions {
  std::vector<int64_t> start[2], pos[2];
  Positions(const World& w, int64_t rank);
};

// The pieces rank `rank` holds of parameter p on side s, appended to `out` (index order not
// guaranteed).
void own_pieces(const World& w, int64_t p, int s, int64_t rank, const Positions& pos,
                std::vector<Query>& out);

void sort_unique(std::vector<Query>& qs);

}  // namespace awex::plan::detail
