// Ingestion and canonicalisation of both sides' metadata, and the digest (the checks that need
// the whole canonical world, ranks, coverage and overlaps, are in plan_check.cpp).
//
// Canonical form (what the digest hashes and what every rank plans from): parameters sorted by
// name (rows with the same name on one side are merged), explicit pieces of each parameter side
// sorted by (global offset, shape, rank, local offset) with empty pieces dropped, rule uses
// sorted by their rule's fields and rank list. The same metadata in any order therefore gives
// the same plan. Distinct rules (RuleDef) are validated and fingerprinted once; a parameter's use
// of one (RuleRef) is 24 bytes, so 70k parameters sharing a layout cost little.
#include <algorithm>
#include <numeric>

#include "plan/hash.h"
#include "plan/plan.h"
#include "plan/solve.h"
#include "plan/util.h"

namespace awex::plan {
namespace {

std::vector<int64_t> prefix(const std::vector<int64_t>& n) {
  std::vector<int64_t> out(n.size() + 1, 0);
  for (size_t i = 0; i < n.size(); ++i) {
    if (n[i] < 0) throw PlanError("negative length in the encoded metadata");
    out[i + 1] = out[i] + n[i];
  }
  return out;
}

template <typename V>
void expect_size(const V& s, int64_t n, const char* what) {
  if (static_cast<int64_t>(s.size()) != n) {
    throw PlanError(std::string("encoded metadata: array '") + what + "' has " +
                    std::to_string(s.size()) + " entries, expected " + std::to_string(n));
  }
}

// Rows of one side in name order (stable: duplicates keep their input order).
std::vector<int64_t> name_order(const std::vector<std::string_view>& names) {
  std::vector<int64_t> order(names.size());
  std::iota(order.begin(), order.end(), 0);
  auto less = [&](int64_t a, int64_t b) { return names[a] < names[b]; };
  if (!std::is_sorted(order.begin(), order.end(), less)) {
    std::stable_sort(order.begin(), order.end(), less);
  }
  return order;
}

// Canonical order of explicit piece records [rank, off, len, loc]: (offset, shape, rank, local
// offset), so that replicas of one box are adjacent.
bool canonical_less(const int64_t* x, const int64_t* y, int nd) {
  for (int j = 1; j < 1 + 2 * nd; ++j) {
    if (x[j] != y[j]) return x[j] < y[j];
  }
  if (x[0] != y[0]) return x[0] < y[0];
  for (int j = 1 + 2 * nd; j < 1 + 3 * nd; ++j) {
    if (x[j] != y[j]) return x[j] < y[j];
  }
  return false;
}

}  // namespace

// Where each row's pieces, shapes and rule references start in a SideInput's flat arrays
// (prefix sums of the "_n" arrays), checked against the arrays' sizes once.
struct World::InputIndex {
  std::vector<int64_t> shape_at, piece_at, off_at, len_at, ploc_at, rule_at;

  explicit InputIndex(const SideInput& in) {
    const int64_t P = static_cast<int64_t>(in.names.size());
    expect_size(in.ndim, P, "ndim");
    expect_size(in.dtype, P, "dtype");
    expect_size(in.itemsize, P, "itemsize");
    expect_size(in.npieces, P, "npieces");
    expect_size(in.nrules, P, "nrules");
    shape_at = prefix(in.ndim);
    expect_size(in.shape, shape_at.back(), "shape");
    piece_at = prefix(in.npieces);
    const int64_t N = piece_at.back();
    for (const std::vector<int64_t>* a : {&in.piece_rank, &in.piece_off_n, &in.piece_len_n,
                                          &in.piece_loc_n}) {
      expect_size(*a, N, "piece");
    }
    off_at = prefix(in.piece_off_n);
    len_at = prefix(in.piece_len_n);
    ploc_at = prefix(in.piece_loc_n);
    expect_size(in.piece_off, off_at.back(), "piece_off");
    expect_size(in.piece_len, len_at.back(), "piece_len");
    expect_size(in.piece_loc, ploc_at.back(), "piece_loc");
    if (!in.packed.empty()) {
      expect_size(in.packed_n, P, "packed_n");
      expect_size(in.packed, P, "packed");
    }
    rule_at = prefix(in.nrules);
    expect_size(in.rule_ref, rule_at.back(), "rule_ref");
  }
};

void World::ParamError::operator()(const std::string& what) const {
  throw PlanError("parameter '" + name + "' (" + side_name(side) + " side): " + what);
}

World::World(const SideInput& train, const SideInput& infer, int64_t bucket_bytes,
             int64_t min_part_bytes)
    : bucket_bytes_(bucket_bytes), min_part_bytes_(min_part_bytes) {
  if (bucket_bytes <= 0) {
    throw PlanError("bucket_bytes must be positive, got " + std::to_string(bucket_bytes));
  }
  if (min_part_bytes <= 0) {
    throw PlanError("min_part_bytes must be positive, got " + std::to_string(min_part_bytes));
  }
  const SideInput* in[2] = {&train, &infer};
  // Both sides usually list the same names in the same order: then one sort serves both.
  std::vector<int64_t> order[2];
  order[0] = name_order(train.names);
  order[1] = infer.names == train.names ? order[0] : name_order(infer.names);
  std::vector<int64_t> row_param[2];
  merge_names(in, order, row_param);
  for (int s = 0; s < 2; ++s) {
    ingest_defs(s, *in[s], row_param[s]);
    ingest(s, *in[s], order[s], row_param[s]);
  }
  for (Param& P : params_) {  // pieces_ no longer moves: point the copied records at it
    for (int s = 0; s < 2; ++s) {
      SideParam& sp = P.side[s];
      if (sp.present && sp.piece_begin >= 0) sp.recs = pieces_[s].data() + sp.piece_begin;
    }
  }
  check_totals();
  check_ranks();
  detail::Scratch scratch(*this);
  for (int64_t p = 0; p < static_cast<int64_t>(params_.size()); ++p) check_coverage(p, scratch);
}

void World::merge_names(const SideInput* const in[2], const std::vector<int64_t> order[2],
                        std::vector<int64_t> row_param[2]) {
  // Merge the two sorted name lists into the canonical parameter list.
  params_.reserve(std::max(in[0]->names.size(), in[1]->names.size()) + 16);
  for (int s = 0; s < 2; ++s) row_param[s].assign(in[s]->names.size(), -1);
  size_t i[2] = {0, 0};
  while (i[0] < order[0].size() || i[1] < order[1].size()) {
    std::string_view pick;
    bool have = false;
    for (int s = 0; s < 2; ++s) {
      if (i[s] < order[s].size()) {
        const std::string_view n = in[s]->names[order[s][i[s]]];
        if (!have || n < pick) pick = n;
        have = true;
      }
    }
    const int64_t p = static_cast<int64_t>(params_.size());
    params_.emplace_back();
    params_.back().name.assign(pick.data(), pick.size());
    for (int s = 0; s < 2; ++s) {
      while (i[s] < order[s].size() && in[s]->names[order[s][i[s]]] == pick) {
        row_param[s][order[s][i[s]]] = p;
        ++i[s];
      }
    }
  }
}

// ---- distinct rules -------------------------------------------------------------------------

void World::ingest_defs(int s, const SideInput& in, const std::vector<int64_t>& row_param) {
  const int64_t T = static_cast<int64_t>(in.rule_replicas.size());
  for (const std::vector<int64_t>* a : {&in.rule_dims_n, &in.rule_chunks_n, &in.rule_loc_n,
                                        &in.rule_ranks_n}) {
    expect_size(*a, T, "rule");
  }
  DefIndex at{prefix(in.rule_dims_n), prefix(in.rule_chunks_n), prefix(in.rule_loc_n),
              prefix(in.rule_ranks_n)};
  expect_size(in.rule_dims, at.dims.back(), "rule_dims");
  expect_size(in.rule_chunks, at.chunks.back(), "rule_chunks");
  expect_size(in.rule_loc, at.loc.back(), "rule_loc");
  expect_size(in.rule_ranks, at.ranks.back(), "rule_ranks");
  const auto rule_at = prefix(in.nrules);
  expect_size(in.rule_ref, rule_at.back(), "rule_ref");
  rank_pool_[s].resize(static_cast<size_t>(at.ranks.back()));
  defs_[s].resize(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    // A defect names the first parameter using the rule (or the side, if none does).
    auto fail = [&](const std::string& what) {
      for (int64_t row = 0; row + 1 < static_cast<int64_t>(rule_at.size()); ++row) {
        for (int64_t k = rule_at[row]; k < rule_at[row + 1]; ++k) {
          if (in.rule_ref[k] == t) {
            throw PlanError("parameter '" + params_[row_param[row]].name + "' (" + side_name(s) +
                            " side): rule " + std::to_string(k - rule_at[row]) + ": " + what);
          }
        }
      }
      throw PlanError(std::string("a ") + side_name(s) + " rule: " + what);
    };
    read_def(s, in, t, at, fail);
  }
}

template <class Fail>
void World::read_def(int s, const SideInput& in, int64_t t, const DefIndex& at, Fail& fail) {
  RuleDef& d = defs_[s][t];
  d.nsplit = static_cast<int32_t>(in.rule_dims_n[t]);
  if (d.nsplit != in.rule_chunks_n[t] || d.nsplit > kMaxDims) {
    fail("split_dims and num_chunks must have equal length <= " + std::to_string(kMaxDims));
  }
  d.replicas = in.rule_replicas[t];
  if (d.replicas < 1) fail("replicas must be >= 1");
  d.total = 1;
  for (int a = 0; a < d.nsplit; ++a) {
    const int64_t dim = in.rule_dims[at.dims[t] + a];
    const int64_t n = in.rule_chunks[at.chunks[t] + a];
    if (dim < 0 || dim >= kMaxDims) fail("split dim " + std::to_string(dim) + " out of range");
    for (int b = 0; b < a; ++b) {
      if (d.dims[b] == dim) fail("split dim " + std::to_string(dim) + " repeated");
    }
    if (n < 1) fail("num_chunks must be >= 1");
    if (d.total > (int64_t{1} << 40) / n) fail("too many chunks");
    d.dims[a] = static_cast<int32_t>(dim);
    d.chunks[a] = n;
    d.total *= n;
    d.max_dim = std::max<int32_t>(d.max_dim, static_cast<int32_t>(dim));
  }
  d.nranks = in.rule_ranks_n[t];
  if (d.replicas > (int64_t{1} << 40) / d.total || d.nranks != d.total * d.replicas) {
    fail("lists " + std::to_string(d.nranks) + " ranks, expected num_chunks product x " +
         "replicas = " + std::to_string(d.total) + " x " + std::to_string(d.replicas));
  }
  d.nloc = static_cast<int32_t>(in.rule_loc_n[t]);
  if (d.nloc > kMaxDims) fail("local_offset too long");
  for (int k = 0; k < d.nloc; ++k) {
    d.loc[k] = in.rule_loc[at.loc[t] + k];
    if (d.loc[k] < 0) fail("negative local_offset");
  }
  d.ranks_begin = at.ranks[t];
  d.min_rank = INT64_MAX;
  for (int64_t k = 0; k < d.nranks; ++k) {
    const int64_t r = in.rule_ranks[d.ranks_begin + k];
    if (r < 0 || r > INT32_MAX) fail("rank " + std::to_string(r) + " is outside [0, 2^31)");
    rank_pool_[s][d.ranks_begin + k] = static_cast<int32_t>(r);
    d.min_rank = std::min(d.min_rank, r);
    d.max_rank = std::max(d.max_rank, r);
  }
  fingerprint(s, d);
}

void World::fingerprint(int s, RuleDef& d) const {
  Hash128 h;
  h.add(d.nsplit);
  for (int a = 0; a < d.nsplit; ++a) {
    h.add(d.dims[a]);
    h.add_signed(d.chunks[a]);
  }
  h.add_signed(d.replicas);
  h.add(d.nloc);
  for (int k = 0; k < d.nloc; ++k) h.add_signed(d.loc[k]);
  h.add_signed(d.nranks);
  for (int64_t k = 0; k < d.nranks; ++k) h.add(static_cast<uint64_t>(rank_pool_[s][d.ranks_begin + k]));
  d.fp[0] = h.lane_a();
  d.fp[1] = h.lane_b();
}

// ---- parameters -----------------------------------------------------------------------------

void World::ingest(int s, const SideInput& in, const std::vector<int64_t>& order,
                   const std::vector<int64_t>& row_param) {
  const InputIndex ix(in);
  rules_[s].reserve(rules_[s].size() + static_cast<size_t>(ix.rule_at.back()));
  size_t words = static_cast<size_t>(ix.piece_at.back() + ix.off_at.back() + ix.len_at.back() +
                                     ix.ploc_at.back());
  pieces_[s].reserve(pieces_[s].size() + words);
  std::vector<int64_t> recs;  // explicit piece records of the parameter being ingested
  size_t k = 0;
  while (k < order.size()) {
    const int64_t p = row_param[order[k]];
    Param& Pm = params_[p];
    SideParam& sp = Pm.side[s];
    const ParamError fail{Pm.name, s};
    const int64_t row0 = order[k];
    const int nd = ingest_head(s, in, ix, row0, Pm, fail);
    recs.clear();
    sp.rule_begin = static_cast<int64_t>(rules_[s].size());
    // One row whose explicit pieces are all packed, valid and in canonical order (what
    // merge_metas gives): the planner reads the packed buffer in place.
    const bool one_row = k + 1 == order.size() || row_param[order[k + 1]] != p;
    const bool in_place = one_row && !in.packed.empty() && in.packed[row0] &&
                          ix.piece_at[row0 + 1] == ix.piece_at[row0] &&
                          scan_packed(s, Pm, in.packed[row0], in.packed_n[row0]);
    if (in_place) {
      append_rule_refs(s, in, ix, row0, Pm, fail);
      ++k;
      sp.piece_begin = -1;
      canonical_rules(s, sp);
      max_ndim_ = std::max<int32_t>(max_ndim_, nd);
      continue;
    }
    for (; k < order.size() && row_param[order[k]] == p; ++k) {
      const int64_t row = order[k];
      if (in.ndim[row] != nd || in.dtype[row] != sp.dtype ||
          !std::equal(Pm.shape, Pm.shape + nd, in.shape.data() + ix.shape_at[row])) {
        fail("conflicting duplicate entries (global shape or dtype differ)");
      }
      append_pieces(in, ix, row, Pm, recs, fail);
      append_rule_refs(s, in, ix, row, Pm, fail);
    }
    canonical_pieces(s, sp, nd, recs);
    canonical_rules(s, sp);
    max_ndim_ = std::max<int32_t>(max_ndim_, nd);
  }
}

int World::ingest_head(int s, const SideInput& in, const InputIndex& ix, int64_t row, Param& Pm,
                       const ParamError& fail) {
  const int64_t nd = in.ndim[row];
  if (nd < 0 || nd > kMaxDims) {
    fail("ndim " + std::to_string(nd) + " is outside [0, " + std::to_string(kMaxDims) + "]");
  }
  const int64_t* shape = in.shape.data() + ix.shape_at[row];
  for (int d = 0; d < nd; ++d) {
    if (shape[d] < 0) fail("negative global shape " + tuple_str(shape, static_cast<int>(nd)));
  }
  if (s == kTrain || !Pm.side[kTrain].present) {
    Pm.ndim = static_cast<int32_t>(nd);
    std::copy(shape, shape + nd, Pm.shape);
  } else if (Pm.ndim != nd || !std::equal(shape, shape + nd, Pm.shape)) {
    fail("global shape " + tuple_str(shape, static_cast<int>(nd)) +
         " does not match the training side's " + tuple_str(Pm.shape, Pm.ndim));
  }
  SideParam& sp = Pm.side[s];
  sp.present = true;
  sp.dtype = static_cast<int32_t>(in.dtype[row]);
  sp.itemsize = static_cast<int32_t>(in.itemsize[row]);
  if (sp.itemsize <= 0) fail("itemsize must be positive");
  return static_cast<int>(nd);
}

// One explicit piece: checked, and appended to recs unless empty.
void World::add_piece(const Param& Pm, int64_t rank, const int64_t* off, const int64_t* len,
                      const int64_t* loc, int64_t nloc, std::vector<int64_t>& recs,
                      const ParamError& fail) {
  const int nd = Pm.ndim;
  const int64_t* shape = Pm.shape;
  auto who = [&] { return "piece of rank " + std::to_string(rank); };
  if (rank < 0 || rank > INT32_MAX) fail(who() + ": ranks must be in [0, 2^31)");
  bool empty = false;
  for (int d = 0; d < nd; ++d) {
    // len[d] > shape[d] - off[d], not off[d] + len[d] > shape[d]: no int64 overflow.
    if (off[d] < 0 || len[d] < 0 || len[d] > shape[d] - off[d] || (nloc && loc[d] < 0)) {
      fail(who() + " at offset " + tuple_str(off, nd) + " shape " + tuple_str(len, nd) +
           (nloc ? " local offset " + tuple_str(loc, nd) : "") + " lies outside the global shape " +
           tuple_str(shape, nd) + " (or has a negative local offset)");
    }
    empty |= len[d] == 0;
  }
  if (empty) return;
  recs.push_back(rank);
  recs.insert(recs.end(), off, off + nd);
  recs.insert(recs.end(), len, len + nd);
  for (int d = 0; d < nd; ++d) recs.push_back(nloc ? loc[d] : 0);
}

void World::append_pieces(const SideInput& in, const InputIndex& ix, int64_t row, const Param& Pm,
                          std::vector<int64_t>& recs, const ParamError& fail) {
  const int nd = Pm.ndim;
  for (int64_t i = ix.piece_at[row]; i < ix.piece_at[row + 1]; ++i) {
    const int64_t nloc = in.piece_loc_n[i];
    if (in.piece_off_n[i] != nd || in.piece_len_n[i] != nd || (nloc != 0 && nloc != nd)) {
      fail("piece of rank " + std::to_string(in.piece_rank[i]) +
           " has offsets/shape/local offset of the wrong length for ndim " + std::to_string(nd));
    }
    add_piece(Pm, in.piece_rank[i], in.piece_off.data() + ix.off_at[i],
              in.piece_len.data() + ix.len_at[i], in.piece_loc.data() + ix.ploc_at[i], nloc, recs,
              fail);
  }
  if (in.packed.empty() || !in.packed[row]) return;
  // Packed records (merge_metas): a block of valid non-empty records is appended whole;
  // otherwise add_piece drops the empty ones and names the first bad one.
  const int stride = 1 + 3 * nd;
  const int64_t* x0 = in.packed[row];
  const int64_t* end = x0 + in.packed_n[row] * stride;
  bool clean = true;
  for (const int64_t* x = x0; clean && x < end; x += stride) {
    clean = x[0] >= 0 && x[0] <= INT32_MAX;
    for (int d = 0; clean && d < nd; ++d) {
      const int64_t off = x[1 + d], len = x[1 + nd + d], loc = x[1 + 2 * nd + d];
      clean = off >= 0 && len > 0 && len <= Pm.shape[d] - off && loc >= 0;
    }
  }
  if (clean) {
    recs.insert(recs.end(), x0, end);
    return;
  }
  for (const int64_t* x = x0; x < end; x += stride) {
    add_piece(Pm, x[0], x + 1, x + 1 + nd, x + 1 + 2 * nd, nd, recs, fail);
  }
}

void World::append_rule_refs(int s, const SideInput& in, const InputIndex& ix, int64_t row,
                             const Param& Pm, const ParamError& fail) {
  const int nd = Pm.ndim;
  const int64_t T = static_cast<int64_t>(defs_[s].size());
  for (int64_t i = ix.rule_at[row]; i < ix.rule_at[row + 1]; ++i) {
    const int64_t t = in.rule_ref[i];
    if (t < 0 || t >= T) fail("bad rule reference");
    const RuleDef& d = defs_[s][t];
    if (d.max_dim >= nd || (d.nloc != 0 && d.nloc != nd)) {
      fail("rule " + std::to_string(i - ix.rule_at[row]) + " splits dim " +
           std::to_string(d.max_dim) + " or has a local_offset of length " + std::to_string(d.nloc) +
           ", but the parameter has " + std::to_string(nd) + " dims");
    }
    RuleRef ref;
    ref.def = t;
    ref.cells = 1;
    for (int a = 0; a < d.nsplit; ++a) {
      int64_t step, nonempty;
      chunking(Pm.shape[d.dims[a]], d.chunks[a], step, nonempty);
      ref.cells *= nonempty;
    }
    for (int dd = 0; dd < nd; ++dd) {
      if (Pm.shape[dd] == 0) ref.cells = 0;
    }
    rules_[s].push_back(ref);
  }
}

void World::canonical_pieces(int s, SideParam& sp, int nd, const std::vector<int64_t>& recs) {
  const int stride = 1 + 3 * nd;
  const int64_t npc = static_cast<int64_t>(recs.size()) / stride;
  auto rec_less = [&](int64_t a, int64_t b) {
    return canonical_less(&recs[a * stride], &recs[b * stride], nd);
  };
  bool sorted = true;
  for (int64_t j = 1; sorted && j < npc; ++j) sorted = !rec_less(j, j - 1);
  sp.piece_begin = static_cast<int64_t>(pieces_[s].size());
  sp.piece_count = npc;
  if (sorted) {
    pieces_[s].insert(pieces_[s].end(), recs.begin(), recs.end());
  } else {
    std::vector<int64_t> rec_order(static_cast<size_t>(npc));
    std::iota(rec_order.begin(), rec_order.end(), 0);
    std::sort(rec_order.begin(), rec_order.end(), rec_less);
    for (int64_t j : rec_order) {
      pieces_[s].insert(pieces_[s].end(), &recs[j * stride], &recs[j * stride] + stride);
    }
  }
  sp.recs = pieces_[s].data() + sp.piece_begin;  // until pieces_ grows; fixed in the constructor
  piece_ranks(s, sp, nd);
}

bool World::scan_packed(int s, Param& Pm, const int64_t* x0, int64_t n) {
  // One pass over a packed buffer: every record valid and non-empty (as append_pieces' fast path
  // checks) and in canonical order; then its ranks are noted (piece_ranks) while still cached.
  const int nd = Pm.ndim;
  const int stride = 1 + 3 * nd;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t* x = x0 + j * stride;
    if (x[0] < 0 || x[0] > INT32_MAX || (j > 0 && canonical_less(x, x - stride, nd))) return false;
    for (int d = 0; d < nd; ++d) {
      const int64_t off = x[1 + d], len = x[1 + nd + d], loc = x[1 + 2 * nd + d];
      if (off < 0 || len <= 0 || len > Pm.shape[d] - off || loc < 0) return false;
    }
  }
  SideParam& sp = Pm.side[s];
  sp.recs = x0;
  sp.piece_count = n;
  piece_ranks(s, sp, nd);
  return true;
}

void World::piece_ranks(int s, SideParam& sp, int nd) {
  // Rank range, the side's bit in seen_, and whether some rank holds two pieces (stamp_).
  const int stride = 1 + 3 * nd;
  const uint8_t bit = static_cast<uint8_t>(1u << s);
  if (++stamp_id_ == 0) {  // wrapped: old stamps could collide
    std::fill(stamp_.begin(), stamp_.end(), 0);
    stamp_id_ = 1;
  }
  sp.min_rank = INT64_MAX;
  sp.max_rank = -1;
  sp.rank_dup = false;
  for (int64_t j = 0; j < sp.piece_count; ++j) {
    const int64_t r = sp.recs[j * stride];
    sp.min_rank = std::min(sp.min_rank, r);
    sp.max_rank = std::max(sp.max_rank, r);
    if (r >= kMarkRanks) {
      seen_all_ = false;
      sp.rank_dup = true;  // not tracked: let the overlap check look
      continue;
    }
    if (r >= static_cast<int64_t>(seen_.size())) {
      seen_.resize(static_cast<size_t>(std::max<int64_t>(r + 1, 2 * seen_.size())), 0);
      stamp_.resize(seen_.size(), 0);
    }
    seen_[r] |= bit;
    sp.rank_dup |= stamp_[r] == stamp_id_;
    stamp_[r] = stamp_id_;
  }
}

void World::canonical_rules(int s, SideParam& sp) {
  // Canonical order of rule uses: the rule's fields, then its rank list.
  const auto& defs = defs_[s];
  const auto& pool = rank_pool_[s];
  sp.rule_count = static_cast<int64_t>(rules_[s].size()) - sp.rule_begin;
  auto def_less = [&](const RuleRef& ra, const RuleRef& rb) {
    if (ra.def == rb.def) return false;
    const RuleDef& a = defs[ra.def];
    const RuleDef& b = defs[rb.def];
    if (a.nsplit != b.nsplit) return a.nsplit < b.nsplit;
    for (int j = 0; j < a.nsplit; ++j) {
      if (a.dims[j] != b.dims[j]) return a.dims[j] < b.dims[j];
      if (a.chunks[j] != b.chunks[j]) return a.chunks[j] < b.chunks[j];
    }
    if (a.replicas != b.replicas) return a.replicas < b.replicas;
    if (a.nloc != b.nloc) return a.nloc < b.nloc;
    for (int j = 0; j < a.nloc; ++j) {
      if (a.loc[j] != b.loc[j]) return a.loc[j] < b.loc[j];
    }
    const int32_t* x = &pool[a.ranks_begin];
    const int32_t* y = &pool[b.ranks_begin];
    return std::lexicographical_compare(x, x + a.nranks, y, y + b.nranks);
  };
  auto first = rules_[s].begin() + sp.rule_begin;
  if (sp.rule_count > 1) std::stable_sort(first, rules_[s].end(), def_less);
  int64_t base = sp.piece_count;
  for (auto it = first; it != rules_[s].end(); ++it) {
    it->piece_base = base;
    const RuleDef& d = defs[it->def];
    base += it->cells * d.replicas;
    if (it->cells > 0) {
      sp.min_rank = std::min(sp.min_rank, d.min_rank);
      sp.max_rank = std::max(sp.max_rank, d.max_rank);
    }
  }
  sp.expanded = base;
  if (sp.max_rank < 0) sp.min_rank = 0;
}

Rule World::rule(int s, const Param& P, int64_t i) const {
  const RuleRef& ref = rules_[s][i];
  const RuleDef& d = defs_[s][ref.def];
  Rule r;
  r.nsplit = d.nsplit;
  for (int a = 0; a < d.nsplit; ++a) {
    r.dims[a] = d.dims[a];
    r.chunks[a] = d.chunks[a];
    chunking(P.shape[d.dims[a]], d.chunks[a], r.step[a], r.nonempty[a]);
  }
  r.total = d.total;
  r.cells = ref.cells;
  r.replicas = d.replicas;
  r.table = ref.def;
  r.ranks_begin = d.ranks_begin;
  r.has_loc = d.nloc != 0;
  r.loc = d.loc;
  r.piece_base = ref.piece_base;
  return r;
}

std::string World::digest() const {
  Hash128 h;
  for (uint64_t w : {uint64_t{0x6E616C7078657761ULL}, static_cast<uint64_t>(kPlannerVersion),
                     static_cast<uint64_t>(bucket_bytes_), static_cast<uint64_t>(kOpAlign),
                     static_cast<uint64_t>(min_part_bytes_), static_cast<uint64_t>(params_.size())}) {
    h.add(w);
  }
  for (const Param& P : params_) {
    h.add_bytes(P.name);
    h.add(P.ndim);
    for (int d = 0; d < P.ndim; ++d) h.add_signed(P.shape[d]);
    for (int s = 0; s < 2; ++s) {
      const SideParam& sp = P.side[s];
      h.add(sp.present);
      if (!sp.present) continue;
      h.add_signed(sp.dtype);
      h.add_signed(sp.itemsize);
      h.add_signed(sp.piece_count);
      const int64_t words = sp.piece_count * (1 + 3 * P.ndim);
      for (int64_t j = 0; j < words; ++j) h.add_signed(sp.recs[j]);
      h.add_signed(sp.rule_count);
      for (int64_t i = 0; i < sp.rule_count; ++i) {
        const RuleDef& d = defs_[s][rules_[s][sp.rule_begin + i].def];
        h.add(d.fp[0]);
        h.add(d.fp[1]);
      }
    }
  }
  return h.hex();
}

}  // namespace awex::plan
