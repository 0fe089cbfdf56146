// Per-rank plans (the solver itself: plan/solve.h): the queries a rank takes part in, their ops,
// then the ops grouped by peer and cut into buckets.
#include <algorithm>
#include <numeric>

#include "plan/plan.h"
#include "plan/solve.h"

namespace awex::plan {
using namespace detail;  // the solver's vocabulary (plan/solve.h)

namespace {

// Writes one op row (bucket columns still empty) per solver op that involves `rank`.
struct RowSink {
  std::vector<int64_t>& raw;
  const Param* P;
  const Query* q;
  int64_t p, W, D, rank, kind;
  void cell(const std::vector<Holder>&, const int64_t*, int64_t, int64_t) {}
  void op(const Holder& h, const HBox& b, const int64_t* lo, const int64_t* len) {
    if (kind == 0 && h.rank != rank) return;
    const int nd = P->ndim;
    const size_t at = raw.size();
    raw.resize(at + W, 0);
    int64_t* row = &raw[at];
    int64_t vol = 1;
    for (int d = 0; d < nd; ++d) vol *= len[d];
    row[kOpKind] = kind;
    row[kOpPeer] = kind == 0 ? q->rank : h.rank;
    row[kOpParam] = p;
    row[kOpSrcDtype] = P->side[kTrain].dtype;
    row[kOpDstDtype] = P->side[kInfer].dtype;
    row[kOpNbytes] = vol * P->side[kInfer].itemsize;
    row[kOpNdim] = nd;
    int64_t* so = row + kOpBoxes;
    int64_t* dof = so + D;
    int64_t* sh = dof + D;
    for (int d = 0; d < D; ++d) sh[d] = 1;
    for (int d = 0; d < nd; ++d) {
      so[d] = lo[d] - b.off[d] + b.loc[d];
      dof[d] = lo[d] - q->off[d] + q->loc[d];
      sh[d] = len[d];
    }
  }
};

// Inference pieces of P that overlap any of a training rank's pieces `mine`, into `out`
// (sorted by expanded index, each once).
void overlapping_queries(const World& w, const Param& P, const std::vector<Query>& mine,
                         std::vector<Query>& out) {
  out.clear();
  const SideParam& inf = P.side[kInfer];
  const int nd = P.ndim;
  for (const Query& b : mine) {
    for (int64_t i = 0; i < inf.piece_count; ++i) {
      const int64_t* r = w.piece(kInfer, inf, i, nd);
      bool hit = true;
      for (int d = 0; d < nd && hit; ++d) {
        hit = std::max(r[1 + d], b.off[d]) < std::min(r[1 + d] + r[1 + nd + d], b.off[d] + b.len[d]);
      }
      if (!hit) continue;
      Query q;
      load_piece(w, kInfer, inf, i, r, nd, q);
      out.push_back(q);
    }
    Query q;
    for (int64_t k = 0; k < inf.rule_count; ++k)
      for_rule_queries(w, P, w.rule(kInfer, P, inf.rule_begin + k), b.off, b.len, q,
                       [&](const Query& cell) { out.push_back(cell); });
  }
  sort_unique(out);
}

}  // namespace

void World::plan_rank(int64_t rank, std::vector<int64_t>& ops, std::vector<int64_t>& buckets) const {
  std::vector<int64_t> raw;  // op rows, bucket columns still empty
  rank_ops(rank, raw);
  bucketize(raw, ops, buckets);
}

void World::rank_ops(int64_t rank, std::vector<int64_t>& raw) const {
  const int64_t W = op_cols();
  const int D = max_ndim_;
  const Positions pos(*this, rank);
  Scratch s(*this);
  std::vector<Query> mine, queries;
  for (int64_t p = 0; p < static_cast<int64_t>(params_.size()); ++p) {
    const Param& P = params_[p];
    if (!P.side[kTrain].present || !P.side[kInfer].present) continue;
    for (int kind = 0; kind < 2; ++kind) {  // 0: rank sends (training), 1: it receives
      const int side = kind == 0 ? kTrain : kInfer;
      const SideParam& own = P.side[side];
      if (rank < own.min_rank || rank > own.max_rank) continue;
      mine.clear();
      own_pieces(*this, p, side, rank, pos, mine);
      if (mine.empty()) continue;
      if (kind == 1) {
        sort_unique(mine);
        queries = mine;
      } else {
        overlapping_queries(*this, P, mine, queries);
      }
      for (const Query& q : queries) {
        RowSink sink{raw, &P, &q, p, W, D, rank, kind};
        solve(*this, p, q, s, sink);
      }
    }
  }
}

void World::bucketize(const std::vector<int64_t>& raw, std::vector<int64_t>& ops,
                      std::vector<int64_t>& buckets) const {
  // Group by (kind, peer), keep the (parameter, query, cell, slab) order inside each group, cut
  // into buckets.
  const int64_t W = op_cols();
  const int D = max_ndim_;
  const int64_t n = static_cast<int64_t>(raw.size()) / W;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t* x = &raw[a * W];
    const int64_t* y = &raw[b * W];
    return x[kOpKind] != y[kOpKind] ? x[kOpKind] < y[kOpKind] : x[kOpPeer] < y[kOpPeer];
  });
  ops.clear();
  buckets.clear();
  ops.reserve(raw.size());
  BucketFill fill;
  int64_t group_kind = -1, group_peer = -1;
  for (int64_t i : order) {
    const int64_t* row = &raw[i * W];
    if (row[kOpKind] != group_kind || row[kOpPeer] != group_peer) {
      group_kind = row[kOpKind];
      group_peer = row[kOpPeer];
      fill = BucketFill();
    }
    const Param& P = params_[row[kOpParam]];
    const int nd = P.ndim;
    const int64_t isz = P.side[kInfer].itemsize;
    split_for_buckets(row + kOpBoxes + 2 * D, nd, isz, bucket_bytes_,
                      [&](const int64_t* delta, const int64_t* sub) {
                        int64_t vol = 1;
                        for (int d = 0; d < nd; ++d) vol *= sub[d];
                        const int64_t nb = vol * isz;
                        bool fresh = false;
                        const int64_t off = fill.place(nb, bucket_bytes_, fresh);
                        if (fresh) {
                          buckets.insert(buckets.end(), {group_kind, group_peer, fill.count - 1,
                                                         static_cast<int64_t>(ops.size()) / W, 0, 0, 0});
                        }
                        int64_t* b = &buckets[buckets.size() - kBucketCols];
                        const size_t at = ops.size();
                        ops.insert(ops.end(), row, row + W);
                        int64_t* o = &ops[at];
                        o[kOpBucket] = static_cast<int64_t>(buckets.size()) / kBucketCols - 1;
                        o[kOpByteOffset] = off;
                        o[kOpNbytes] = nb;
                        for (int d = 0; d < nd; ++d) {
                          o[kOpBoxes + d] += delta[d];
                          o[kOpBoxes + D + d] += delta[d];
                          o[kOpBoxes + 2 * D + d] = sub[d];
                        }
                        b[kBOpCount] += 1;
                        b[kBNbytes] = off + nb;
                        b[kBPayload] += nb;
                      });
  }
}

}  // namespace awex::plan
