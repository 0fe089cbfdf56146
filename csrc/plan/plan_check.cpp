// Checks that need the whole canonical world: sizes within the planner's limits, no transfer
// rank on both sides, every needed region held by some training piece, and no rank holding two
// overlapping pieces.
#include <algorithm>
#include <numeric>

#include "plan/plan.h"
#include "plan/solve.h"
#include "plan/util.h"

namespace awex::plan {
using namespace detail;  // the solver's vocabulary (plan/solve.h)

namespace {

// Whether two of `boxes` (records [rank, off[nd], len[nd], loc[nd]]) overlap, their boxes read
// at column `at` (1: global offsets, 1 + 2 nd: local offsets) with extents at 1 + nd. Sort and
// sweep along the dim with the most distinct starts (for pieces cut along one dim, every box
// then meets only its neighbours).
bool any_overlap(std::vector<const int64_t*>& boxes, int at, int nd) {
  const size_t n = boxes.size();
  if (n < 2) return false;
  if (nd == 0) return true;  // 0-d: every non-empty piece is the whole scalar
  int best = 0;
  size_t best_distinct = 0;
  std::vector<int64_t> starts(n);
  for (int d = 0; d < nd && n > 8; ++d) {
    for (size_t i = 0; i < n; ++i) starts[i] = boxes[i][at + d];
    std::sort(starts.begin(), starts.end());
    const size_t distinct = static_cast<size_t>(std::unique(starts.begin(), starts.end()) - starts.begin());
    if (distinct > best_distinct) best = d, best_distinct = distinct;
  }
  std::sort(boxes.begin(), boxes.end(),
            [&](const int64_t* a, const int64_t* b) { return a[at + best] < b[at + best]; });
  for (size_t i = 0; i < n; ++i) {
    const int64_t* a = boxes[i];
    for (size_t j = i + 1; j < n && boxes[j][at + best] < a[at + best] + a[1 + nd + best]; ++j) {
      const int64_t* b = boxes[j];
      bool hit = true;
      for (int d = 0; d < nd && hit; ++d) {
        hit = a[at + d] < b[at + d] + b[1 + nd + d] && b[at + d] < a[at + d] + a[1 + nd + d];
      }
      if (hit) return true;
    }
  }
  return false;
}

}  // namespace

int64_t World::first_overlap(int s) const {
  int64_t max_rank = -1;
  for (const Param& P : params_) max_rank = std::max(max_rank, P.side[s].max_rank);
  std::vector<int64_t> stamp(static_cast<size_t>(max_rank + 1), -1);
  std::vector<int32_t> count(static_cast<size_t>(max_rank + 1), 0);
  for (int64_t p = 0; p < static_cast<int64_t>(params_.size()); ++p) {
    if (param_overlaps(s, p, stamp, count)) return p;
  }
  return -1;
}

bool World::param_overlaps(int s, int64_t p, std::vector<int64_t>& stamp,
                           std::vector<int32_t>& count) const {
  const Param& P = params_[p];
  const SideParam& sp = P.side[s];
  if (!sp.present) return false;
  if (!sp.rank_dup && sp.rule_count == 0) return false;  // every rank holds one piece at most
  const int nd = P.ndim;
  const int stride = 1 + 3 * nd;
  // Only a rank holding more than one piece can overlap itself: count pieces per rank first.
  bool dup = false;
  auto see = [&](int64_t r) {
    if (stamp[r] != p) stamp[r] = p, count[r] = 0;
    dup |= ++count[r] > 1;
  };
  const int64_t zero[kMaxDims] = {};
  auto for_rule_pieces = [&](auto&& f) {  // f(rank, off, ext, rule) for every rule piece
    for (int64_t k = 0; k < sp.rule_count; ++k) {
      const Rule R = rule(s, P, sp.rule_begin + k);
      for_rule_cells(P, R, zero, P.shape, [&](int64_t c, int64_t, const int64_t* off, const int64_t* ext) {
        for (int64_t j = 0; j < R.replicas; ++j) f(pool(s, R.ranks_begin + j * R.total + c), off, ext, R);
      });
    }
  };
  for (int64_t i = 0; i < sp.piece_count; ++i) see(piece(s, sp, i, nd)[0]);
  for_rule_pieces([&](int64_t r, const int64_t*, const int64_t*, const Rule&) { see(r); });
  if (!dup) return false;
  // The pieces of ranks holding several, as records, grouped by rank.
  std::vector<int64_t> recs;
  for (int64_t i = 0; i < sp.piece_count; ++i) {
    const int64_t* x = piece(s, sp, i, nd);
    if (count[x[0]] > 1) recs.insert(recs.end(), x, x + stride);
  }
  for_rule_pieces([&](int64_t r, const int64_t* off, const int64_t* ext, const Rule& R) {
    if (count[r] < 2) return;
    recs.push_back(r);
    recs.insert(recs.end(), off, off + nd);
    recs.insert(recs.end(), ext, ext + nd);
    for (int d = 0; d < nd; ++d) recs.push_back(R.has_loc ? R.loc[d] : 0);
  });
  std::vector<const int64_t*> all(recs.size() / stride), group;
  for (size_t i = 0; i < all.size(); ++i) all[i] = &recs[i * stride];
  std::stable_sort(all.begin(), all.end(), [](const int64_t* a, const int64_t* b) { return a[0] < b[0]; });
  for (size_t i = 0; i < all.size();) {
    size_t j = i;
    while (j < all.size() && all[j][0] == all[i][0]) ++j;
    for (int at : {1, 1 + 2 * nd}) {
      group.assign(all.begin() + static_cast<std::ptrdiff_t>(i),
                   all.begin() + static_cast<std::ptrdiff_t>(j));
      if (any_overlap(group, at, nd)) return true;
    }
    i = j;
  }
  return false;
}

void World::check_totals() const {
  int64_t max_item = 1;
  int64_t total_bytes = 0;
  for (const Param& P : params_) {
    total_bytes += check_size(P);
    if (total_bytes > kMaxTotalBytes) {
      throw PlanError("parameter '" + P.name + "' takes the parameters' total past the planner's " +
                      "limit of 2^62 bytes");
    }
    if (P.side[kInfer].present && !P.side[kTrain].present) {
      throw PlanError("parameter '" + P.name +
                      "' is needed by the inference side but missing on the training side");
    }
    if (P.side[kInfer].present) max_item = std::max<int64_t>(max_item, P.side[kInfer].itemsize);
  }
  if (bucket_bytes_ < max_item) {
    throw PlanError("bucket_bytes " + std::to_string(bucket_bytes_) +
                    " is smaller than one element (" + std::to_string(max_item) + " bytes)");
  }
}

int64_t World::check_size(const Param& P) {
  // Elements, then bytes, each step checked against kMaxParamBytes before it can overflow.
  int64_t numel = 1;
  for (int d = 0; d < P.ndim; ++d) {
    if (P.shape[d] != 0 && numel > kMaxParamBytes / P.shape[d]) numel = kMaxParamBytes + 1;
    else numel *= P.shape[d];
  }
  int64_t bytes = 0;
  for (int s = 0; s < 2; ++s) {
    const SideParam& sp = P.side[s];
    if (!sp.present) continue;
    if (numel > kMaxParamBytes / sp.itemsize) {
      throw PlanError("parameter '" + P.name + "' (" + side_name(s) + " side): global shape " +
                      tuple_str(P.shape, P.ndim) + " of " + std::to_string(sp.itemsize) +
                      "-byte elements exceeds the planner's limit of 2^48 bytes per parameter");
    }
    bytes = std::max(bytes, numel * sp.itemsize);
  }
  return bytes;
}

bool World::holds(int s, const Param& P, int64_t rank) const {
  const SideParam& sp = P.side[s];
  if (!sp.present || rank < sp.min_rank || rank > sp.max_rank) return false;
  for (int64_t i = 0; i < sp.piece_count; ++i) {
    if (piece(s, sp, i, P.ndim)[0] == rank) return true;
  }
  for (int64_t i = 0; i < sp.rule_count; ++i) {
    const RuleRef& ref = rules_[s][sp.rule_begin + i];
    const RuleDef& d = defs_[s][ref.def];
    const int32_t* x = &rank_pool_[s][d.ranks_begin];
    if (ref.cells > 0 && std::find(x, x + d.nranks, rank) != x + d.nranks) return true;
  }
  return false;
}

void World::check_ranks() {
  // Mark every rank that holds a piece on each side; a rank on both sides cannot be planned.
  int64_t max_rank = -1;
  for (const Param& P : params_) {
    for (int s = 0; s < 2; ++s) max_rank = std::max(max_rank, P.side[s].max_rank);
  }
  // Explicit pieces were marked in seen_ as they were read (unless a rank was too large).
  std::vector<uint8_t> seen(std::move(seen_));
  seen.resize(static_cast<size_t>(max_rank + 1), 0);
  if (!seen_all_) std::fill(seen.begin(), seen.end(), 0);
  for (int s = 0; s < 2; ++s) {
    const uint8_t bit = static_cast<uint8_t>(1u << s);
    std::vector<uint8_t> def_used(defs_[s].size(), 0);
    for (const Param& P : params_) {
      const SideParam& sp = P.side[s];
      if (!sp.present) continue;
      const int stride = 1 + 3 * P.ndim;
      for (int64_t i = 0; !seen_all_ && i < sp.piece_count; ++i) seen[sp.recs[i * stride]] |= bit;
      for (int64_t i = 0; i < sp.rule_count; ++i) {
        const RuleRef& ref = rules_[s][sp.rule_begin + i];
        if (ref.cells > 0) def_used[ref.def] = 1;
      }
    }
    for (size_t t = 0; t < defs_[s].size(); ++t) {
      if (!def_used[t]) continue;
      const RuleDef& d = defs_[s][t];
      for (int64_t j = 0; j < d.nranks; ++j) seen[rank_pool_[s][d.ranks_begin + j]] |= bit;
    }
  }
  for (int64_t r = 0; r <= max_rank; ++r) {
    if (seen[r] == 3) {
      std::string where[2];
      for (int s = 0; s < 2; ++s) {
        for (const Param& P : params_) {
          if (holds(s, P, r)) {
            where[s] = P.name;
            break;
          }
        }
      }
      throw PlanError("transfer rank " + std::to_string(r) +
                      " appears on both sides (training, e.g. parameter '" + where[0] +
                      "', and inference, e.g. parameter '" + where[1] +
                      "'): inference ranks and training ranks must be disjoint");
    }
    for (int s = 0; s < 2; ++s) {
      if (seen[r] & (1u << s)) side_ranks_[s].push_back(r);
    }
  }
}

void World::check_coverage(int64_t p, Scratch& s) const {
  const Param& P = params_[p];
  if (!P.side[kTrain].present || !P.side[kInfer].present || P.side[kInfer].expanded == 0) return;
  if (P.side[kTrain].rule_count > 0) return;  // a rule tiles the whole tensor
  const SideParam& tr = P.side[kTrain];
  const int nd = P.ndim;
  for (int64_t i = 0; i < tr.piece_count; ++i) {  // a piece of the whole tensor covers it
    const int64_t* r = piece(kTrain, tr, i, nd);
    bool full = true;
    for (int d = 0; d < nd && full; ++d) full = r[1 + d] == 0 && r[1 + nd + d] == P.shape[d];
    if (full) return;
  }
  int64_t zero[kMaxDims] = {};
  gather(*this, p, zero, P.shape, s);
  bool covered = !s.holders.empty();
  if (covered) {
    int64_t total = 0;
    try {
      total = build_grid(P, zero, P.shape, s);
    } catch (const PlanError&) {
      covered = false;  // too fragmented for one grid: check every inference piece instead
    }
    for (int64_t c = 0; covered && c < total; ++c) covered = s.cell_start[c + 1] > s.cell_start[c];
  }
  if (covered) return;
  // Some region has no training piece: an error only if an inference piece needs it.
  NullSink sink;
  Query q;
  for_each_query(*this, p, q, [&](const Query& qq) { solve(*this, p, qq, s, sink); });
}

}  // namespace awex::plan
