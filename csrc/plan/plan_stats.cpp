// World-wide counts over every (sender, receiver) pair, without materialising ops: bytes per
// rank, the replica balance and its bounds, ops and buckets after splitting (the same
// BucketFill / split_for_buckets the per-rank plans use, fed in the same per-pair order).
#include <algorithm>
#include <unordered_map>

#include "plan/plan.h"
#include "plan/solve.h"

namespace awex::plan {
using namespace detail;  // the solver's vocabulary (plan/solve.h)

namespace {

// Bytes per distinct holder set (sorted sender indices). Whatever the replica choice, the
// senders of a set S together send every region whose holders all lie in S, so the busiest of
// them sends at least B(subsets of S) / |S|: the maximum over S is a lower bound for any plan.
class HolderSets {
 public:
  void add(const std::vector<Holder>& H, const int64_t* ids, int64_t m,
           const std::vector<int64_t>& sidx, int64_t bytes) {
    tmp_.clear();
    for (int64_t i = 0; i < m; ++i) tmp_.push_back(sidx[H[ids[i]].rank]);
    std::sort(tmp_.begin(), tmp_.end());
    tmp_.erase(std::unique(tmp_.begin(), tmp_.end()), tmp_.end());
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    for (int64_t x : tmp_) h = (h ^ static_cast<uint64_t>(x)) * 0x100000001B3ULL;
    for (;; ++h) {  // open addressing over the 64-bit hash
      auto it = index_.find(h);
      if (it == index_.end()) {
        index_.emplace(h, static_cast<int64_t>(sets_.size()));
        sets_.push_back(tmp_);
        bytes_.push_back(static_cast<double>(bytes));
        return;
      }
      if (sets_[it->second] == tmp_) {
        bytes_[it->second] += static_cast<double>(bytes);
        return;
      }
    }
  }
  double bound() const {
    const size_t k = sets_.size();
    double best = 0;
    for (size_t a = 0; a < k; ++a) {
      double total = bytes_[a];
      if (k <= 4096) {  // subsets too (quadratic); beyond that, exact sets only
        for (size_t b = 0; b < k; ++b) {
          if (b != a && sets_[b].size() <= sets_[a].size() &&
              std::includes(sets_[a].begin(), sets_[a].end(), sets_[b].begin(), sets_[b].end())) {
            total += bytes_[b];
          }
        }
      }
      best = std::max(best, total / static_cast<double>(sets_[a].size()));
    }
    return best;
  }

 private:
  std::unordered_map<uint64_t, int64_t> index_;
  std::vector<std::vector<int64_t>> sets_;
  std::vector<double> bytes_;
  std::vector<int64_t> tmp_;
};

// Counts one pair's ops into WorldStats (fed every query of every parameter, per pair in order).
struct StatsSink {
  WorldStats& st;
  const World& w;
  const std::vector<int64_t>& sidx;
  const std::vector<int64_t>& ridx;
  std::vector<BucketFill>& dense_fill;
  std::unordered_map<int64_t, BucketFill>& sparse_fill;
  HolderSets& sets;
  bool dense;
  int64_t R;
  const Param* P;
  const Query* q;
  void cell(const std::vector<Holder>& H, const int64_t* ids, int64_t m, int64_t bytes) {
    sets.add(H, ids, m, sidx, bytes);
    const double share = static_cast<double>(bytes) / static_cast<double>(m);
    for (int64_t i = 0; i < m; ++i) st.even_bytes[sidx[H[ids[i]].rank]] += share;
  }
  void op(const Holder& h, const HBox&, const int64_t*, const int64_t* len) {
    const int nd = P->ndim;
    const int64_t isz = P->side[kInfer].itemsize;
    const int64_t si = sidx[h.rank], ri = ridx[q->rank];
    BucketFill& f = dense ? dense_fill[si * R + ri] : sparse_fill[si * R + ri];
    int64_t vol = 1;
    for (int d = 0; d < nd; ++d) vol *= len[d];
    st.send_bytes[si] += vol * isz;
    st.recv_bytes[ri] += vol * isz;
    st.total_bytes += vol * isz;
    split_for_buckets(len, nd, isz, w.bucket_bytes(), [&](const int64_t*, const int64_t* sub) {
      int64_t v = 1;
      for (int d = 0; d < nd; ++d) v *= sub[d];
      bool fresh = false;
      const int64_t before = f.fill;
      const int64_t off = f.place(v * isz, w.bucket_bytes(), fresh);
      st.wire_bytes += fresh ? (st.buckets++, v * isz) : off + v * isz - before;
      ++st.ops;
    });
  }
};

}  // namespace

void World::stats_ranks(WorldStats& st, std::vector<int64_t>& sidx, std::vector<int64_t>& ridx) const {
  // Dense indices of senders (training ranks of needed parameters) and receivers.
  int64_t max_rank = -1;
  for (int s = 0; s < 2; ++s) {
    if (!side_ranks_[s].empty()) max_rank = std::max(max_rank, side_ranks_[s].back());
  }
  sidx.assign(static_cast<size_t>(max_rank + 1), -1);
  ridx = sidx;
  std::vector<uint8_t> needed(static_cast<size_t>(max_rank + 1), 0);
  std::vector<uint8_t> def_needed(static_cast<size_t>(num_defs(kTrain)), 0);
  for (const Param& P : params_) {
    if (!P.side[kTrain].present || !P.side[kInfer].present) continue;
    const SideParam& sp = P.side[kTrain];
    for (int64_t i = 0; i < sp.piece_count; ++i) needed[piece(kTrain, sp, i, P.ndim)[0]] = 1;
    for (int64_t k = 0; k < sp.rule_count; ++k) {
      const Rule R = rule(kTrain, P, sp.rule_begin + k);
      if (R.cells > 0) def_needed[R.table] = 1;
    }
  }
  for (int64_t t = 0; t < num_defs(kTrain); ++t) {
    if (!def_needed[t]) continue;
    const RuleDef& d = def(kTrain, t);
    for (int64_t j = 0; j < d.nranks; ++j) needed[pool(kTrain, d.ranks_begin + j)] = 1;
  }
  for (int64_t r : side_ranks_[kTrain]) {
    if (!needed[r]) continue;
    sidx[r] = static_cast<int64_t>(st.senders.size());
    st.senders.push_back(r);
  }
  for (int64_t r : side_ranks_[kInfer]) {
    ridx[r] = static_cast<int64_t>(st.receivers.size());
    st.receivers.push_back(r);
  }
}

WorldStats World::world_stats() const {
  WorldStats st;
  std::vector<int64_t> sidx, ridx;
  stats_ranks(st, sidx, ridx);
  const int64_t S = static_cast<int64_t>(st.senders.size());
  const int64_t R = static_cast<int64_t>(st.receivers.size());
  st.send_bytes.assign(S, 0);
  st.even_bytes.assign(S, 0.0);
  st.recv_bytes.assign(R, 0);
  const bool dense = S * R <= (int64_t{1} << 22);
  std::vector<BucketFill> dense_fill(dense ? static_cast<size_t>(S * R) : 0);
  std::unordered_map<int64_t, BucketFill> sparse_fill;
  HolderSets sets;
  Scratch s(*this);
  Query q;
  for (int64_t p = 0; p < static_cast<int64_t>(params_.size()); ++p) {
    const Param& P = params_[p];
    if (!P.side[kTrain].present || !P.side[kInfer].present) continue;
    for_each_query(*this, p, q, [&](const Query& qq) {
      StatsSink sink{st, *this, sidx, ridx, dense_fill, sparse_fill, sets, dense, R, &P, &qq};
      solve(*this, p, qq, s, sink);
    });
  }
  for (const BucketFill& f : dense_fill) st.pairs += f.count > 0;
  st.pairs += static_cast<int64_t>(sparse_fill.size());
  st.bound_bytes = sets.bound();
  return st;
}

}  // namespace awex::plan
