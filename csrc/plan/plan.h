// Native resharding planner: which box of which parameter each training rank sends to each
// inference rank, balanced over training replicas and cut into buckets.
//
// Why native: a Kimi-K2-sized MoE has ~70k tensors and ~9M inference pieces; planning them in
// Python objects (as Awex 0.9 does) costs seconds per rank. Here the metadata objects are read
// once into flat int64 arrays (plan_bindings.cpp; merge_metas' packed records are read in place),
// rules stay rules (a compact grid over a rank list, expanded on the fly), and one rank's plan
// comes back as one int64 array.
//
// Locality: every decision about a parameter is a pure function of that parameter's metadata
// (and bucketing of a (sender, receiver) pair only of that pair's ops, in order), so
// plan_rank(r) costs a scan of the metadata plus r's own ops, and the sender and the receiver
// of every op derive it independently and agree. No torch, no Python: see plan_bindings.cpp.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace awex::plan {
namespace detail {
struct Scratch;
}

constexpr int kMaxDims = 8;
// Bumped whenever the plan a given metadata produces changes; part of every digest.
constexpr int64_t kPlannerVersion = 2;
// Each op starts at a multiple of this inside its bucket (the wire layout; >= any itemsize).
constexpr int64_t kOpAlign = 16;
// Default for World's min_part_bytes: a region held by several training replicas is split among
// them only into parts of at least this many receiver-dtype bytes; smaller regions go whole to
// one replica.
constexpr int64_t kMinPartBytes = 64 << 10;

// Largest parameter the planner accepts, in bytes of either side's dtype (256 TiB), and the
// largest sum over all parameters (2^62): every byte count and offset it computes then fits in
// int64 (a (2^31, 2^31) float32 parameter is 2^64 bytes). Beyond them: PlanError naming the
// parameter.
constexpr int64_t kMaxParamBytes = int64_t{1} << 48;
constexpr int64_t kMaxTotalBytes = int64_t{1} << 62;

enum Side : int { kTrain = 0, kInfer = 1 };

// Metadata that cannot be planned (missing names, shape mismatches, colliding ranks, regions no
// training piece covers, malformed pieces or rules). The message names the parameter.
class PlanError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Columns of one op row in a rank's op array: [n_ops, kOpBoxes + 3 * max_ndim] int64.
// Boxes follow: src_offset[D] (sender's local coords), dst_offset[D] (receiver's local coords),
// shape[D]; dims past the parameter's ndim are 0 (offsets) and 1 (shape).
enum OpCol : int {
  kOpKind = 0,     // 0: this rank sends, 1: this rank receives
  kOpPeer,         // the other transfer rank
  kOpBucket,       // row of the bucket in this rank's bucket array
  kOpParam,        // index into the plan's canonical (sorted, merged) parameter list
  kOpSrcDtype,     // dtype codes (awex_fast/plan/planner.py::DTYPES)
  kOpDstDtype,
  kOpByteOffset,   // where the op's packed bytes (receiver dtype) start inside the bucket
  kOpNbytes,       // packed bytes in the receiver's dtype
  kOpNdim,
  kOpBoxes
};

// Columns of one bucket row: [n_buckets, kBucketCols] int64. Sends first, then receives, each
// sorted by (peer, seq); ops of a bucket are rows [op_begin, op_begin + op_count).
enum BucketCol : int { kBKind = 0, kBPeer, kBSeq, kBOpBegin, kBOpCount, kBNbytes, kBPayload, kBucketCols };

// One side's metadata as flat arrays ([P] per parameter row, [N] per explicit piece, [R] per
// rule reference, [U] per distinct rule; "flat" arrays are the concatenated tuples, "_n" their
// lengths). Distinct rules are listed once and referenced by index, so 70k parameters sharing
// one inference layout cost one rank list. Filled by plan_bindings.cpp straight from the
// Python metadata objects; names point into those objects' UTF-8 buffers.
struct SideInput {
  std::vector<std::string_view> names;                          // [P]
  std::vector<int64_t> ndim, shape, dtype, itemsize;            // [P], flat, [P], [P]
  std::vector<int64_t> npieces, nrules;                         // [P]: of each row, in order
  std::vector<int64_t> piece_rank, piece_off_n, piece_off, piece_len_n, piece_len, piece_loc_n,
      piece_loc;                                                // [N] (+ flat)
  // [P] or empty: more explicit pieces of row p, packed[p] -> packed_n[p] records
  // [rank, off[ndim], len[ndim], loc[ndim]] (null / 0: none). Packed by merge_metas once, so
  // that a row of 64 pieces is one buffer, not 64 objects; the buffers outlive the World
  // (plan_bindings.cpp keeps them alive as long as it), which may read them in place.
  std::vector<const int64_t*> packed;
  std::vector<int64_t> packed_n;
  std::vector<int64_t> rule_ref;                                // [R] -> distinct rule
  std::vector<int64_t> rule_replicas, rule_dims_n, rule_dims, rule_chunks_n, rule_chunks,
      rule_loc_n, rule_loc, rule_ranks_n, rule_ranks;           // [U] (+ flat)
};

// A distinct ShardRule as given, shared by every parameter that uses it: split_dims[s] cut into
// chunks[s] chunks (torch.chunk arithmetic); cell c (row-major over chunks) of replica j is
// held by rank_pool[ranks_begin + j * total + c].
struct RuleDef {
  int32_t nsplit = 0;
  int32_t dims[kMaxDims] = {};
  int64_t chunks[kMaxDims] = {};
  int64_t total = 1, replicas = 1;
  int64_t ranks_begin = 0, nranks = 0;
  int32_t nloc = 0;      // 0 (zeros) or the ndim the local offset was written for
  int64_t loc[kMaxDims] = {};
  int32_t max_dim = -1;  // largest split dim
  int64_t min_rank = 0, max_rank = -1;
  uint64_t fp[2] = {};   // fingerprint of every field and the rank list (digest)
};

// One parameter's use of a RuleDef: `cells` non-empty cells for this parameter's shape; its
// pieces have expanded indices [piece_base, piece_base + cells * replicas).
struct RuleRef {
  int64_t def = 0;
  int64_t cells = 0;
  int64_t piece_base = 0;
};

// A RuleRef resolved against its parameter's shape (what the solver iterates): `step[s]`
// elements per chunk, `nonempty[s]` non-empty chunks along split dim s.
struct Rule {
  int32_t nsplit = 0;
  int32_t dims[kMaxDims];
  int64_t chunks[kMaxDims], step[kMaxDims], nonempty[kMaxDims];
  int64_t total = 1, cells = 0, replicas = 1;
  int64_t table = 0;  // the RuleDef id (rank-position caches are per def)
  int64_t ranks_begin = 0;
  bool has_loc = false;
  const int64_t* loc = nullptr;
  int64_t piece_base = 0;
};

// One parameter's pieces on one side. Explicit pieces are records [rank, off[nd], len[nd],
// loc[nd]] in World::pieces[side], sorted by (off, len, rank, loc) so replicas of a box are
// adjacent; their expanded index is their position. Rule pieces follow, rule by rule, cell-major
// (non-empty cells in row-major order) and replica-minor.
struct SideParam {
  bool present = false;
  int32_t dtype = -1;
  int32_t itemsize = 0;
  int64_t piece_begin = 0, piece_count = 0;  // piece_begin: into World::pieces_, or -1
  // The records: World::pieces_ + piece_begin, or a packed buffer (merge_metas) already in
  // canonical order, which the World's owner keeps alive (plan_bindings.cpp): never copied.
  const int64_t* recs = nullptr;
  int64_t rule_begin = 0, rule_count = 0;
  int64_t expanded = 0;
  int64_t min_rank = 0, max_rank = -1;
  // Some rank may hold two explicit pieces (set at ingestion; false proves it cannot).
  bool rank_dup = false;
};

struct Param {
  std::string name;
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  SideParam side[2];
};

struct WorldStats {
  int64_t total_bytes = 0;    // payload, receiver dtypes
  int64_t wire_bytes = 0;     // with kOpAlign padding inside buckets
  int64_t ops = 0;            // after bucket splitting
  int64_t buckets = 0;
  int64_t pairs = 0;
  std::vector<int64_t> senders, send_bytes;       // every training rank of a needed parameter
  std::vector<int64_t> receivers, recv_bytes;     // every inference rank
  std::vector<double> even_bytes;                 // per sender: every region split evenly
  double bound_bytes = 0;  // no plan's busiest sender sends less (see plan_stats.cpp)
};

class World {
 public:
  // Canonicalises and validates both sides; throws PlanError.
  World(const SideInput& train, const SideInput& infer, int64_t bucket_bytes,
        int64_t min_part_bytes = kMinPartBytes);

  // One rank's ops and buckets (see OpCol / BucketCol).
  void plan_rank(int64_t rank, std::vector<int64_t>& ops, std::vector<int64_t>& buckets) const;
  // Every pair's ops, counted without materialising them.
  WorldStats world_stats() const;
  // 128-bit digest of the canonical metadata, bucket_bytes and kPlannerVersion, as 32 hex digits.
  std::string digest() const;
  // The first parameter (canonical index) of `side` with two non-empty pieces of one rank that
  // overlap in global space or in the rank's local tensor, or -1 (plan_check.cpp). The
  // constructor has checked each piece alone; build_plan asks this once per side and lets
  // awex_fast.meta.validate_metas name the pieces when it finds one.
  int64_t first_overlap(int side) const;

  int64_t op_cols() const { return kOpBoxes + 3 * static_cast<int64_t>(max_ndim_); }
  const std::vector<Param>& params() const { return params_; }
  const std::vector<int64_t>& side_ranks(int side) const { return side_ranks_[side]; }
  int64_t bucket_bytes() const { return bucket_bytes_; }
  int64_t min_part_bytes() const { return min_part_bytes_; }

  // Internal accessors for the solver (plan_solve.cpp).
  const int64_t* piece(int side, const SideParam& sp, int64_t i, int nd) const {
    (void)side;
    return sp.recs + i * (1 + 3 * nd);
  }
  Rule rule(int side, const Param& P, int64_t i) const;
  const RuleDef& def(int side, int64_t d) const { return defs_[side][d]; }
  int64_t num_defs(int side) const { return static_cast<int64_t>(defs_[side].size()); }
  int32_t pool(int side, int64_t i) const { return rank_pool_[side][i]; }

 private:
  struct InputIndex;  // row offsets into one SideInput's flat arrays (plan_world.cpp)
  struct DefIndex {   // where each distinct rule's fields start in a SideInput's flat arrays
    std::vector<int64_t> dims, chunks, loc, ranks;
  };
  struct ParamError {  // throws PlanError("parameter '<name>' (<side> side): <what>")
    const std::string& name;
    int side;
    [[noreturn]] void operator()(const std::string& what) const;
  };

  // Ingestion (plan_world.cpp), in the order the constructor runs it.
  void merge_names(const SideInput* const in[2], const std::vector<int64_t> order[2],
                   std::vector<int64_t> row_param[2]);
  void ingest_defs(int side, const SideInput& in, const std::vector<int64_t>& row_param);
  template <class Fail>
  void read_def(int side, const SideInput& in, int64_t t, const DefIndex& at, Fail& fail);
  void fingerprint(int side, RuleDef& d) const;
  void ingest(int side, const SideInput& in, const std::vector<int64_t>& order,
              const std::vector<int64_t>& row_param);
  int ingest_head(int side, const SideInput& in, const InputIndex& ix, int64_t row, Param& Pm,
                  const ParamError& fail);
  static void add_piece(const Param& Pm, int64_t rank, const int64_t* off, const int64_t* len,
                        const int64_t* loc, int64_t nloc, std::vector<int64_t>& recs,
                        const ParamError& fail);
  static void append_pieces(const SideInput& in, const InputIndex& ix, int64_t row, const Param& Pm,
                            std::vector<int64_t>& recs, const ParamError& fail);
  void append_rule_refs(int side, const SideInput& in, const InputIndex& ix, int64_t row,
                        const Param& Pm, const ParamError& fail);
  bool scan_packed(int side, Param& Pm, const int64_t* x0, int64_t n);
  void piece_ranks(int side, SideParam& sp, int nd);
  void canonical_pieces(int side, SideParam& sp, int nd, const std::vector<int64_t>& recs);
  void canonical_rules(int side, SideParam& sp);
  // Whole-world checks (plan_check.cpp).
  void check_totals() const;
  static int64_t check_size(const Param& P);  // larger side's bytes; PlanError past the limits
  bool holds(int side, const Param& P, int64_t rank) const;
  void check_ranks();
  void check_coverage(int64_t p, detail::Scratch& s) const;
  bool param_overlaps(int side, int64_t p, std::vector<int64_t>& stamp,
                      std::vector<int32_t>& count) const;
  // World-wide counts (plan_stats.cpp): dense sender / receiver indices.
  void stats_ranks(WorldStats& st, std::vector<int64_t>& sidx, std::vector<int64_t>& ridx) const;
  // Per-rank plans (plan_solve.cpp).
  void rank_ops(int64_t rank, std::vector<int64_t>& raw) const;
  void bucketize(const std::vector<int64_t>& raw, std::vector<int64_t>& ops,
                 std::vector<int64_t>& buckets) const;

  std::vector<Param> params_;
  std::vector<int64_t> pieces_[2];
  std::vector<RuleDef> defs_[2];
  std::vector<RuleRef> rules_[2];
  std::vector<int32_t> rank_pool_[2];
  std::vector<int64_t> side_ranks_[2];
  // Per rank below kMarkRanks, filled while reading explicit pieces: bit s set if the rank holds
  // one on side s (check_ranks), and the last parameter side that counted it (rank_dup).
  static constexpr int64_t kMarkRanks = int64_t{1} << 22;
  std::vector<uint8_t> seen_;
  std::vector<uint32_t> stamp_;
  uint32_t stamp_id_ = 0;
  bool seen_all_ = true;  // false: some rank >= kMarkRanks, check_ranks scans the pieces
  int64_t bucket_bytes_ = 0;
  int64_t min_part_bytes_ = kMinPartBytes;
  int32_t max_ndim_ = 1;
};

}  // namespace awex::plan
