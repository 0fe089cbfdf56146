// The solver's non-template steps (declared in plan/solve.h, which describes the algorithm):
// gathering a query's holders, cutting it into a grid of cells, a rank's own pieces.
#include <algorithm>

#include "plan/solve.h"

namespace awex::plan::detail {

void uncovered(const Param& P, const Query& q, const int64_t* lo, const int64_t* len) {
  throw PlanError("parameter '" + P.name + "': inference rank " + std::to_string(q.rank) +
                  " needs the region at global offset " + tuple_str(lo, P.ndim) + " shape " +
                  tuple_str(len, P.ndim) + ", which no training piece holds");
}

// Every training piece of parameter p that intersects [lo, lo + len), by expanded index, into
// s.boxes / s.holders.
void gather(const World& w, int64_t p, const int64_t* lo, const int64_t* len, Scratch& s) {
  s.geo_valid = false;
  s.boxes.clear();
  s.holders.clear();
  const Param& P = w.params()[p];
  const SideParam& sp = P.side[kTrain];
  const int nd = P.ndim;
  HBox b;
  for (int64_t i = 0; i < sp.piece_count; ++i) {
    const int64_t* r = w.piece(kTrain, sp, i, nd);
    bool hit = true;
    for (int d = 0; d < nd && hit; ++d) {
      b.lo[d] = std::max(r[1 + d], lo[d]);
      b.hi[d] = std::min(r[1 + d] + r[1 + nd + d], lo[d] + len[d]);
      hit = b.lo[d] < b.hi[d];
    }
    if (!hit) continue;
    std::copy(r + 1, r + 1 + nd, b.off);
    std::copy(r + 1 + 2 * nd, r + 1 + 3 * nd, b.loc);
    // Replicas of one explicit box are adjacent (canonical order): share the geometry.
    bool same = !s.boxes.empty() && s.boxes.back().end == static_cast<int64_t>(s.holders.size());
    for (int d = 0; d < nd && same; ++d) {
      const HBox& x = s.boxes.back();
      same = x.off[d] == b.off[d] && x.loc[d] == b.loc[d] && x.lo[d] == b.lo[d] && x.hi[d] == b.hi[d];
    }
    if (!same) {
      b.first = static_cast<int64_t>(s.holders.size());
      s.boxes.push_back(b);
    }
    s.holders.push_back({i, r[0], static_cast<int64_t>(s.boxes.size()) - 1});
    s.boxes.back().end = static_cast<int64_t>(s.holders.size());
  }
  for (int64_t k = 0; k < sp.rule_count; ++k) {
    const Rule R = w.rule(kTrain, P, sp.rule_begin + k);
    for_rule_cells(P, R, lo, len, [&](int64_t c, int64_t o, const int64_t* off, const int64_t* ext) {
      for (int d = 0; d < nd; ++d) {
        b.off[d] = off[d];
        b.loc[d] = R.has_loc ? R.loc[d] : 0;
        b.lo[d] = std::max(off[d], lo[d]);
        b.hi[d] = std::min(off[d] + ext[d], lo[d] + len[d]);
      }
      b.first = static_cast<int64_t>(s.holders.size());
      b.end = b.first + R.replicas;
      const int64_t box = static_cast<int64_t>(s.boxes.size());
      s.boxes.push_back(b);
      for (int64_t j = 0; j < R.replicas; ++j) {
        s.holders.push_back({R.piece_base + o * R.replicas + j,
                             w.pool(kTrain, R.ranks_begin + j * R.total + c), box});
      }
    });
  }
}

// Cuts [lo, lo + len) on every holder boundary; fills s.cuts, s.ncut, and the holders of each
// cell (CSR: s.cell_start / s.cell_list). Returns the number of cells.
int64_t build_grid(const Param& P, const int64_t* lo, const int64_t* len, Scratch& s) {
  const int nd = P.ndim;
  int64_t total = 1;
  for (int d = 0; d < nd; ++d) {
    auto& c = s.cuts[d];
    c.clear();
    c.push_back(lo[d]);
    c.push_back(lo[d] + len[d]);
    for (const HBox& b : s.boxes) {
      c.push_back(b.lo[d]);
      c.push_back(b.hi[d]);
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
    s.ncut[d] = static_cast<int64_t>(c.size()) - 1;
    total *= s.ncut[d];
    if (total > kMaxCells) {
      throw PlanError("parameter '" + P.name + "': training pieces cut one inference piece into more "
                      "than 2^24 cells; describe the layout with rules or coarser pieces");
    }
  }
  s.cell_start.assign(static_cast<size_t>(total) + 1, 0);
  auto visit = [&](const HBox& h, auto&& f) {
    int64_t a[kMaxDims], b[kMaxDims], idx[kMaxDims];
    for (int d = 0; d < nd; ++d) {
      const auto& c = s.cuts[d];
      a[d] = std::lower_bound(c.begin(), c.end(), h.lo[d]) - c.begin();
      b[d] = std::lower_bound(c.begin(), c.end(), h.hi[d]) - c.begin();
      idx[d] = a[d];
    }
    while (true) {
      int64_t cell = 0;
      for (int d = 0; d < nd; ++d) cell = cell * s.ncut[d] + idx[d];
      f(cell);
      int d = nd - 1;
      for (; d >= 0; --d) {
        if (++idx[d] < b[d]) break;
        idx[d] = a[d];
      }
      if (d < 0) return;
    }
  };
  for (const HBox& b : s.boxes) {
    visit(b, [&](int64_t cell) { s.cell_start[cell + 1] += b.end - b.first; });
  }
  for (int64_t c = 0; c < total; ++c) s.cell_start[c + 1] += s.cell_start[c];
  s.cell_list.resize(static_cast<size_t>(s.cell_start[total]));
  s.fill.assign(static_cast<size_t>(total), 0);
  for (const HBox& b : s.boxes) {
    visit(b, [&](int64_t cell) {
      for (int64_t i = b.first; i < b.end; ++i) s.cell_list[s.cell_start[cell] + s.fill[cell]++] = i;
    });
  }
  return total;
}

Positions::Positions(const World& w, int64_t rank) {
  for (int s = 0; s < 2; ++s) {
    const int64_t T = w.num_defs(s);
    start[s].assign(static_cast<size_t>(T) + 1, 0);
    for (int64_t t = 0; t < T; ++t) {
      const RuleDef& d = w.def(s, t);
      if (rank >= d.min_rank && rank <= d.max_rank) {
        for (int64_t j = 0; j < d.nranks; ++j) {
          if (w.pool(s, d.ranks_begin + j) == rank) pos[s].push_back(j);
        }
      }
      start[s][t + 1] = static_cast<int64_t>(pos[s].size());
    }
  }
}

// The pieces rank `rank` holds of parameter p on side s, appended to `out` (index order not
// guaranteed).
void own_pieces(const World& w, int64_t p, int s, int64_t rank, const Positions& pos,
                std::vector<Query>& out) {
  const Param& P = w.params()[p];
  const SideParam& sp = P.side[s];
  const int nd = P.ndim;
  Query q;
  q.rank = rank;
  for (int64_t i = 0; i < sp.piece_count; ++i) {
    const int64_t* r = w.piece(s, sp, i, nd);
    if (r[0] != rank) continue;
    load_piece(w, s, sp, i, r, nd, q);
    out.push_back(q);
  }
  for (int64_t k = 0; k < sp.rule_count; ++k) {
    const Rule R = w.rule(s, P, sp.rule_begin + k);
    if (R.cells == 0) continue;
    for (int64_t t = pos.start[s][R.table]; t < pos.start[s][R.table + 1]; ++t) {
      const int64_t at = pos.pos[s][t];
      const int64_t j = at / R.total;
      int64_t c = at % R.total;
      int64_t cidx[kMaxDims];
      for (int a = R.nsplit - 1; a >= 0; --a) {
        cidx[a] = c % R.chunks[a];
        c /= R.chunks[a];
      }
      bool empty = false;
      int64_t o = 0;
      for (int d = 0; d < nd; ++d) {
        q.off[d] = 0;
        q.len[d] = P.shape[d];
        q.loc[d] = R.has_loc ? R.loc[d] : 0;
      }
      for (int a = 0; a < R.nsplit; ++a) {
        empty |= cidx[a] >= R.nonempty[a];
        o = o * R.nonempty[a] + cidx[a];
        const int d = R.dims[a];
        q.off[d] = cidx[a] * R.step[a];
        q.len[d] = std::min(P.shape[d], q.off[d] + R.step[a]) - q.off[d];
      }
      if (empty) continue;
      q.index = R.piece_base + o * R.replicas + j;
      q.reps = R.replicas;
      out.push_back(q);
    }
  }
}

void sort_unique(std::vector<Query>& qs) {
  std::sort(qs.begin(), qs.end(), [](const Query& a, const Query& b) { return a.index < b.index; });
  qs.erase(std::unique(qs.begin(), qs.end(),
                       [](const Query& a, const Query& b) { return a.index == b.index; }),
           qs.end());
}

}  // namespace awex::plan::detail
