// Python face of csrc/plan: the only file of the planner that sees Python. Metadata objects are
// read into flat arrays (Encoder, below), plans leave as int64 numpy arrays that own their
// memory.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <unordered_map>

#include "plan/plan.h"

namespace py = pybind11;

namespace awex::plan {
namespace {

// ---------------------------------------------------------------------------------------------
// Metadata objects -> SideInput, in one native pass.
//
// Why here and not in Python: walking 70k ParameterMeta objects column by column in Python
// (attrgetter / chain / fromiter) costs ~35 ms per side on this machine, more than planning a
// rank; reading the same attributes through the C API costs a third of that. The input is any
// sequence of objects with `name`, `global_shape`, `dtype`, `shards` (objects with `rank`,
// `global_offset`, `shape`, `local_offset`) and `rules` (objects with `ranks`, `split_dims`,
// `num_chunks`, `replicas`, `local_offset`), as awex_fast.meta defines them. Rules are
// deduplicated by identity (decoded JSON and generated layouts share rule objects) and then by
// value, so each distinct rank list is read once.

struct Ref {  // owned reference
  PyObject* p = nullptr;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
};

struct Attrs {
  PyObject *name, *global_shape, *dtype, *shards, *rules, *rank, *global_offset, *shape,
      *local_offset, *ranks, *split_dims, *num_chunks, *replicas, *shard_pack;
  Attrs() {
    auto i = [](const char* s) { return PyUnicode_InternFromString(s); };
    name = i("name"), global_shape = i("global_shape"), dtype = i("dtype"), shards = i("shards");
    rules = i("rules"), rank = i("rank"), global_offset = i("global_offset"), shape = i("shape");
    local_offset = i("local_offset"), ranks = i("ranks"), split_dims = i("split_dims");
    num_chunks = i("num_chunks"), replicas = i("replicas"), shard_pack = i("_shard_pack");
  }
};

const Attrs& attrs() {
  static const Attrs* a = new Attrs();  // interned once, never freed (module lifetime)
  return *a;
}

struct VecHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ v.size();
    for (int64_t x : v) h = (h ^ static_cast<uint64_t>(x)) * 0x100000001B3ULL + (h >> 29);
    return static_cast<size_t>(h);
  }
};

class Encoder {
 public:
  Encoder(const char* side, PyObject* codes, const std::vector<int64_t>& itemsizes,
          PyObject* fallback, std::vector<PyObject*>& keep)
      : side_(side), codes_(codes), itemsizes_(itemsizes), fallback_(fallback), keep_(keep) {}

  SideInput run(PyObject* metas) {
    Ref seq(PySequence_Fast(metas, "metas must be a sequence"));
    if (!seq.p) fail_py("the metas");
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.p);
    PyObject** items = PySequence_Fast_ITEMS(seq.p);
    in_.names.reserve(n);
    in_.ndim.reserve(n);
    in_.dtype.reserve(n);
    for (Py_ssize_t k = 0; k < n; ++k) param(items[k], k);
    return std::move(in_);
  }

 private:
  // One metadata object. A merged ParameterMeta carries its fields in its `_shard_pack`
  // (awex_fast.meta.merge_metas): two attribute reads instead of six.
  void param(PyObject* m, Py_ssize_t k) {
    const Attrs& A = attrs();
    where_ = nullptr;
    PyObject* pack = own_pack(m);  // held in keep_ (or null)
    PyObject* name = pack ? PyTuple_GET_ITEM(pack, 3) : get(m, A.name, "name");
    if (!pack) keep_.push_back(name);  // kept alive until the World is built
    Py_ssize_t len = 0;
    const char* utf8 = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &len) : nullptr;
    if (!utf8) fail("metas[" + std::to_string(k) + "].name must be a string");
    in_.names.emplace_back(utf8, static_cast<size_t>(len));
    where_ = &in_.names.back();
    {
      Ref shape(field(m, pack, 4, A.global_shape, "global_shape"));
      in_.ndim.push_back(ints(shape.p, in_.shape, "global_shape"));
    }
    {
      Ref dt(field(m, pack, 5, A.dtype, "dtype"));
      dtype(dt.p, name);
    }
    if (!packed(pack, in_.ndim.back())) {
      Ref shards(get(m, A.shards, "shards"));
      Ref fast(PySequence_Fast(shards.p, "shards must be a sequence"));
      if (!fast.p) fail_py("shards");
      const Py_ssize_t ns = PySequence_Fast_GET_SIZE(fast.p);
      in_.npieces.push_back(ns);
      for (Py_ssize_t j = 0; j < ns; ++j) shard(PySequence_Fast_GET_ITEM(fast.p, j));
    }
    Ref rules(field(m, pack, 6, A.rules, "rules"));
    Ref fast(PySequence_Fast(rules.p, "rules must be a sequence"));
    if (!fast.p) fail_py("rules");
    const Py_ssize_t nr = PySequence_Fast_GET_SIZE(fast.p);
    in_.nrules.push_back(nr);
    for (Py_ssize_t j = 0; j < nr; ++j) in_.rule_ref.push_back(rule(PySequence_Fast_GET_ITEM(fast.p, j)));
  }
  // Field i of the pack (new reference), or attribute `attr` of m without one.
  PyObject* field(PyObject* m, PyObject* pack, Py_ssize_t i, PyObject* attr, const char* what) const {
    if (!pack) return get(m, attr, what);
    PyObject* v = PyTuple_GET_ITEM(pack, i);
    Py_INCREF(v);
    return v;
  }
  void dtype(PyObject* dt, PyObject* name) {
    int64_t code = -1;
    if (PyUnicode_Check(dt)) {
      PyObject* c = PyDict_GetItemWithError(codes_, dt);  // borrowed
      if (c) code = PyLong_AsLongLong(c);
      if (PyErr_Occurred()) fail_py("dtype");
    }
    if (code < 0) {  // not a canonical name: let Python normalise it (or raise PlanError)
      Ref c(PyObject_CallFunctionObjArgs(fallback_, dt, name, nullptr));
      if (!c.p) throw py::error_already_set();
      code = PyLong_AsLongLong(c.p);
    }
    if (code < 0 || code >= static_cast<int64_t>(itemsizes_.size())) fail("bad dtype code");
    in_.dtype.push_back(code);
    in_.itemsize.push_back(itemsizes_[code]);
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw PlanError(where_ ? "parameter '" + std::string(*where_) + "' (" + side_ + " side): " + what
                           : std::string(side_) + " metadata: " + what);
  }
  [[noreturn]] void fail_py(const std::string& what) const {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    std::string msg = what;
    if (value) {
      Ref str(PyObject_Str(value));
      const char* c = str.p ? PyUnicode_AsUTF8(str.p) : nullptr;
      if (c) msg += std::string(": ") + c;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
    fail(msg);
  }
  PyObject* get(PyObject* o, PyObject* attr, const char* what) const {
    PyObject* v = PyObject_GetAttr(o, attr);
    if (!v) fail_py(std::string("cannot read ") + what);
    return v;
  }
  int64_t as_int(PyObject* v, const char* what) const {
    const long long x = PyLong_AsLongLong(v);  // uses __index__ for numpy ints
    if (x == -1 && PyErr_Occurred()) fail_py(std::string(what) + " must be integers");
    return x;
  }
  // Appends the ints of a sequence (None: nothing) to out; returns how many.
  int64_t ints(PyObject* seq, std::vector<int64_t>& out, const char* what) const {
    if (seq == Py_None) return 0;
    if (PyTuple_CheckExact(seq)) {
      const Py_ssize_t n = PyTuple_GET_SIZE(seq);
      for (Py_ssize_t i = 0; i < n; ++i) out.push_back(as_int(PyTuple_GET_ITEM(seq, i), what));
      return n;
    }
    Ref fast(PySequence_Fast(seq, "expected a sequence of integers"));
    if (!fast.p) fail_py(what);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.p);
    for (Py_ssize_t i = 0; i < n; ++i) out.push_back(as_int(PySequence_Fast_GET_ITEM(fast.p, i), what));
    return n;
  }
  void shard(PyObject* sh) {
    const Attrs& A = attrs();
    Ref rank(get(sh, A.rank, "shard rank"));
    in_.piece_rank.push_back(as_int(rank.p, "shard rank"));
    Ref off(get(sh, A.global_offset, "shard global_offset"));
    in_.piece_off_n.push_back(ints(off.p, in_.piece_off, "shard global_offset"));
    Ref shape(get(sh, A.shape, "shard shape"));
    in_.piece_len_n.push_back(ints(shape.p, in_.piece_len, "shard shape"));
    Ref loc(get(sh, A.local_offset, "shard local_offset"));
    in_.piece_loc_n.push_back(ints(loc.p, in_.piece_loc, "shard local_offset"));
  }
  // m's `_shard_pack` (set by awex_fast.meta.merge_metas, see pack_shards below) when it
  // describes m: (shards, ndim, bytes of int64 records [rank, off[nd], len[nd], loc[nd]], name,
  // global_shape, dtype, rules), its shards being the very `shards` object m holds (metadata
  // objects are frozen: the other fields were read from m when the pack was made). Held in keep_
  // for the World's life (the World reads the records in place); null when there is none.
  PyObject* own_pack(PyObject* m) {
    const Attrs& A = attrs();
    PyObject* pack = PyObject_GetAttr(m, A.shard_pack);
    if (!pack) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) fail_py("cannot read _shard_pack");
      PyErr_Clear();
      return nullptr;
    }
    Ref hold(pack);
    if (!PyTuple_CheckExact(pack) || PyTuple_GET_SIZE(pack) != 7) return nullptr;
    Ref shards(get(m, A.shards, "shards"));
    if (PyTuple_GET_ITEM(pack, 0) != shards.p || !PyTuple_CheckExact(shards.p) ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(pack, 2))) {
      return nullptr;
    }
    keep_.push_back(pack);
    hold.p = nullptr;
    return pack;
  }
  // The explicit pieces from the pack's records; false (nothing appended) without a pack or
  // when its records do not match ndim: the caller then reads the pieces one by one.
  bool packed(PyObject* pack, int64_t nd) {
    in_.packed.push_back(nullptr);
    in_.packed_n.push_back(0);
    if (!pack) return false;
    const long long pnd = PyLong_AsLongLong(PyTuple_GET_ITEM(pack, 1));
    if (pnd == -1 && PyErr_Occurred()) PyErr_Clear();
    PyObject* bytes = PyTuple_GET_ITEM(pack, 2);
    const int64_t stride = 1 + 3 * nd;
    const int64_t n = PyTuple_GET_SIZE(PyTuple_GET_ITEM(pack, 0));
    if (pnd != nd || PyBytes_GET_SIZE(bytes) != static_cast<Py_ssize_t>(n * stride * 8)) return false;
    in_.packed.back() = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(bytes));
    in_.packed_n.back() = n;
    in_.npieces.push_back(0);
    return true;
  }
  int64_t rule(PyObject* r) {
    auto hit = by_ptr_.find(r);
    if (hit != by_ptr_.end()) return hit->second;
    const Attrs& A = attrs();
    key_.clear();
    Ref dims(get(r, A.split_dims, "rule split_dims"));
    const int64_t nd = ints(dims.p, key_, "rule split_dims");
    Ref chunks(get(r, A.num_chunks, "rule num_chunks"));
    const int64_t nc = ints(chunks.p, key_, "rule num_chunks");
    Ref reps(get(r, A.replicas, "rule replicas"));
    key_.push_back(as_int(reps.p, "rule replicas"));
    Ref loc(get(r, A.local_offset, "rule local_offset"));
    const int64_t nl = ints(loc.p, key_, "rule local_offset");
    Ref ranks(get(r, A.ranks, "rule ranks"));
    const int64_t nr = ints(ranks.p, key_, "rule ranks");
    key_.push_back(nd);
    key_.push_back(nc);
    key_.push_back(nl);
    auto [it, fresh] = by_value_.emplace(key_, static_cast<int64_t>(in_.rule_replicas.size()));
    if (fresh) {
      const int64_t* k = key_.data();
      in_.rule_dims_n.push_back(nd);
      in_.rule_dims.insert(in_.rule_dims.end(), k, k + nd);
      in_.rule_chunks_n.push_back(nc);
      in_.rule_chunks.insert(in_.rule_chunks.end(), k + nd, k + nd + nc);
      in_.rule_replicas.push_back(k[nd + nc]);
      in_.rule_loc_n.push_back(nl);
      in_.rule_loc.insert(in_.rule_loc.end(), k + nd + nc + 1, k + nd + nc + 1 + nl);
      in_.rule_ranks_n.push_back(nr);
      in_.rule_ranks.insert(in_.rule_ranks.end(), k + nd + nc + 1 + nl, k + nd + nc + 1 + nl + nr);
    }
    Py_INCREF(r);  // the pointer key must stay unique while the map lives
    keep_.push_back(r);
    by_ptr_.emplace(r, it->second);
    return it->second;
  }

  const char* side_;
  PyObject* codes_;
  const std::vector<int64_t>& itemsizes_;
  PyObject* fallback_;
  std::vector<PyObject*>& keep_;
  const std::string_view* where_ = nullptr;
  SideInput in_;
  std::vector<int64_t> key_;
  std::unordered_map<PyObject*, int64_t> by_ptr_;
  std::unordered_map<std::vector<int64_t>, int64_t, VecHash> by_value_;
};

// ---------------------------------------------------------------------------------------------
// merge_metas' native half (awex_fast/meta/merge.py): the distinct shards of one merged parameter, in
// merge order, and their planner records, read once so that build_plan never reads them again.

// Reads exactly `nd` ints of a tuple/sequence into out; false (error cleared) on anything else.
bool read_exact(PyObject* seq, int64_t nd, int64_t* out) {
  Ref fast(PySequence_Fast(seq, ""));
  if (!fast.p || PySequence_Fast_GET_SIZE(fast.p) != nd) {
    PyErr_Clear();
    return false;
  }
  for (int64_t i = 0; i < nd; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast.p, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// (order, packed) for a list of ShardMeta objects of a parameter with `nd` dims: `order` lists
// the positions of the distinct shards sorted by awex_fast.meta._shard_key (rank, global offset,
// local offset, shape, local offset given), the first of equal ones kept, as `dict.fromkeys`
// then `sorted` would; None when that is the input order. `packed` holds their records
// [rank, off[nd], len[nd], loc[nd]] (loc zeros when not given) as native-endian int64 bytes, in
// the planner's canonical order.
// Returns None when a shard cannot be read as nd-dim integers: the caller then merges in Python
// and build_plan reports the defect with the parameter's name.
py::object pack_shards(const py::sequence& shards, int64_t nd) {
  if (nd < 0 || nd > kMaxDims) return py::none();
  const Attrs& A = attrs();
  const int64_t n = static_cast<int64_t>(py::len(shards));
  const int64_t kw = 2 + 3 * nd;  // key: rank, off, loc, len, has_loc
  std::vector<int64_t> keys(static_cast<size_t>(n * kw));
  for (int64_t j = 0; j < n; ++j) {
    int64_t* k = &keys[j * kw];
    py::object sh = shards[static_cast<size_t>(j)];
    Ref rank(PyObject_GetAttr(sh.ptr(), A.rank)), off(PyObject_GetAttr(sh.ptr(), A.global_offset)),
        len(PyObject_GetAttr(sh.ptr(), A.shape)), loc(PyObject_GetAttr(sh.ptr(), A.local_offset));
    if (!rank.p || !off.p || !len.p || !loc.p) {
      PyErr_Clear();
      return py::none();
    }
    k[0] = PyLong_AsLongLong(rank.p);
    if (k[0] == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return py::none();
    }
    k[kw - 1] = loc.p != Py_None;
    if (!read_exact(off.p, nd, k + 1) || !read_exact(len.p, nd, k + 1 + 2 * nd)) return py::none();
    if (k[kw - 1] && !read_exact(loc.p, nd, k + 1 + nd)) return py::none();
    if (!k[kw - 1]) std::fill(k + 1 + nd, k + 1 + 2 * nd, 0);
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto key = [&](int64_t j) { return &keys[j * kw]; };
  auto less = [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(key(a), key(a) + kw, key(b), key(b) + kw);
  };
  if (!std::is_sorted(order.begin(), order.end(), less)) std::stable_sort(order.begin(), order.end(), less);
  order.erase(std::unique(order.begin(), order.end(),
                          [&](int64_t a, int64_t b) { return std::equal(key(a), key(a) + kw, key(b)); }),
              order.end());
  bool identity = static_cast<int64_t>(order.size()) == n;
  for (size_t i = 0; identity && i < order.size(); ++i) identity = order[i] == static_cast<int64_t>(i);
  // Records in the planner's canonical order (offset, shape, rank, local offset; plan_world.cpp),
  // so that build_plan finds them sorted.
  std::vector<int64_t> by_box(order);
  auto box_less = [&](int64_t a, int64_t b) {
    const int64_t *x = key(a), *y = key(b);
    for (int64_t j : {int64_t{0}, int64_t{2}}) {  // offset, then shape
      const int64_t at = 1 + j * nd;
      if (!std::equal(x + at, x + at + nd, y + at)) {
        return std::lexicographical_compare(x + at, x + at + nd, y + at, y + at + nd);
      }
    }
    if (x[0] != y[0]) return x[0] < y[0];
    return std::lexicographical_compare(x + 1 + nd, x + 1 + 2 * nd, y + 1 + nd, y + 1 + 2 * nd);
  };
  if (!std::is_sorted(by_box.begin(), by_box.end(), box_less)) std::sort(by_box.begin(), by_box.end(), box_less);
  const int64_t stride = 1 + 3 * nd;
  std::string packed(by_box.size() * stride * sizeof(int64_t), '\0');
  auto* rec = reinterpret_cast<int64_t*>(packed.data());
  for (size_t i = 0; i < by_box.size(); ++i, rec += stride) {
    const int64_t* k = key(by_box[i]);
    rec[0] = k[0];
    std::copy(k + 1, k + 1 + nd, rec + 1);                   // offset
    std::copy(k + 1 + 2 * nd, k + 1 + 3 * nd, rec + 1 + nd);  // shape
    std::copy(k + 1 + nd, k + 1 + 2 * nd, rec + 1 + 2 * nd);  // local offset
  }
  py::object ord = identity ? py::object(py::none()) : py::object(py::cast(order));
  return py::make_tuple(ord, py::bytes(packed));
}

py::array_t<int64_t> to_numpy(std::vector<int64_t>&& v, int64_t cols) {
  auto* owned = new std::vector<int64_t>(std::move(v));
  py::capsule free_it(owned, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  const int64_t rows = cols ? static_cast<int64_t>(owned->size()) / cols : 0;
  return py::array_t<int64_t>({rows, cols}, {cols * 8, int64_t{8}}, owned->data(), free_it);
}

py::array_t<int64_t> vec_numpy(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

class PyWorld {
 public:
  PyWorld(const py::object& train, const py::object& infer, int64_t bucket_bytes,
          const py::dict& dtype_codes, const std::vector<int64_t>& itemsizes,
          const py::object& dtype_fallback, int64_t min_part_bytes) {
    std::vector<PyObject*>& keep = keep_.refs;
    const SideInput t = Encoder("training", dtype_codes.ptr(), itemsizes, dtype_fallback.ptr(), keep)
                            .run(train.ptr());
    const SideInput i = Encoder("inference", dtype_codes.ptr(), itemsizes, dtype_fallback.ptr(), keep)
                            .run(infer.ptr());
    py::gil_scoped_release release;
    world_ = std::make_unique<World>(t, i, bucket_bytes, min_part_bytes);
  }

  py::tuple plan_rank(int64_t rank) const {
    std::vector<int64_t> ops, buckets;
    {
      py::gil_scoped_release release;
      world_->plan_rank(rank, ops, buckets);
    }
    return py::make_tuple(to_numpy(std::move(ops), world_->op_cols()),
                          to_numpy(std::move(buckets), kBucketCols));
  }

  py::dict world_stats() const {
    WorldStats st;
    {
      py::gil_scoped_release release;
      st = world_->world_stats();
    }
    py::dict d;
    d["total_bytes"] = st.total_bytes;
    d["wire_bytes"] = st.wire_bytes;
    d["ops"] = st.ops;
    d["buckets"] = st.buckets;
    d["pairs"] = st.pairs;
    d["senders"] = vec_numpy(st.senders);
    d["send_bytes"] = vec_numpy(st.send_bytes);
    d["receivers"] = vec_numpy(st.receivers);
    d["recv_bytes"] = vec_numpy(st.recv_bytes);
    d["bound_bytes"] = st.bound_bytes;
    py::array_t<double> even(static_cast<py::ssize_t>(st.even_bytes.size()));
    std::copy(st.even_bytes.begin(), st.even_bytes.end(), even.mutable_data());
    d["even_bytes"] = even;
    return d;
  }

  std::string digest() const {
    py::gil_scoped_release release;
    return world_->digest();
  }

  py::list names() const {
    py::list out;
    for (const Param& P : world_->params()) out.append(py::str(P.name));
    return out;
  }

  // [P, 5 + kMaxDims]: ndim, train dtype (-1: absent), infer dtype (-1: absent), train itemsize,
  // infer itemsize, global shape (padded with 0).
  py::array_t<int64_t> param_table() const {
    const auto& ps = world_->params();
    std::vector<int64_t> v;
    v.reserve(ps.size() * (5 + kMaxDims));
    for (const Param& P : ps) {
      v.push_back(P.ndim);
      for (int s = 0; s < 2; ++s) v.push_back(P.side[s].present ? P.side[s].dtype : -1);
      for (int s = 0; s < 2; ++s) v.push_back(P.side[s].present ? P.side[s].itemsize : 0);
      for (int d = 0; d < kMaxDims; ++d) v.push_back(d < P.ndim ? P.shape[d] : 0);
    }
    return to_numpy(std::move(v), 5 + kMaxDims);
  }

  py::array_t<int64_t> side_ranks(int side) const {
    if (side != kTrain && side != kInfer) throw PlanError("side must be 0 (training) or 1 (inference)");
    return vec_numpy(world_->side_ranks(side));
  }

  int64_t op_cols() const { return world_->op_cols(); }

  int64_t first_overlap(int side) const {
    if (side != kTrain && side != kInfer) throw PlanError("side must be 0 (training) or 1 (inference)");
    py::gil_scoped_release release;
    return world_->first_overlap(side);
  }

 private:
  // Names, rules and packed shard buffers the encoders read: the World reads packed buffers in
  // place for its whole life (SideParam::recs), so they are released only after it (members are
  // destroyed in reverse order; Python holds the GIL when it frees a PyWorld).
  struct Refs {
    std::vector<PyObject*> refs;
    Refs() = default;
    Refs(const Refs&) = delete;
    Refs& operator=(const Refs&) = delete;
    ~Refs() {
      for (PyObject* o : refs) Py_DECREF(o);
    }
  } keep_;
  std::unique_ptr<World> world_;
};

}  // namespace

void register_apis(py::module_& m) {
  auto sub = m.def_submodule("plan", "resharding planner (see csrc/plan/plan.h)");
  py::register_exception<PlanError>(sub, "PlanError", PyExc_ValueError);
  sub.attr("VERSION") = kPlannerVersion;
  sub.attr("MAX_DIMS") = kMaxDims;
  sub.attr("OP_ALIGN") = kOpAlign;
  sub.attr("MIN_PART_BYTES") = kMinPartBytes;
  sub.attr("MAX_PARAM_BYTES") = kMaxParamBytes;
  sub.attr("MAX_TOTAL_BYTES") = kMaxTotalBytes;
  sub.attr("OP_BOXES") = static_cast<int>(kOpBoxes);
  sub.attr("BUCKET_COLS") = static_cast<int>(kBucketCols);
  sub.def("pack_shards", &pack_shards, py::arg("shards"), py::arg("ndim"),
          "(order or None, packed int64 records) of a parameter's distinct shards; None when a "
          "shard is not nd-dim integers (see awex_fast.meta.merge_metas).");
  py::class_<PyWorld>(sub, "World")
      .def(py::init<const py::object&, const py::object&, int64_t, const py::dict&,
                    const std::vector<int64_t>&, const py::object&, int64_t>(),
           py::arg("train_metas"), py::arg("infer_metas"), py::arg("bucket_bytes"),
           py::arg("dtype_codes"), py::arg("itemsizes"), py::arg("dtype_fallback"),
           py::arg("min_part_bytes") = kMinPartBytes,
           "Read, canonicalise and validate both sides' metas (raises PlanError). dtype_codes maps "
           "canonical dtype names to codes, itemsizes[code] is the element size, "
           "dtype_fallback(dtype, name) -> code handles any other dtype object.")
      .def("plan_rank", &PyWorld::plan_rank, py::arg("rank"),
           "(ops [n, op_cols] int64, buckets [b, BUCKET_COLS] int64) of one transfer rank.")
      .def("world_stats", &PyWorld::world_stats, "Counts over every pair, no ops materialised.")
      .def("digest", &PyWorld::digest, "32 hex digits over the canonical metadata.")
      .def("names", &PyWorld::names, "Canonical (sorted, merged) parameter names.")
      .def("param_table", &PyWorld::param_table, "[P, 5 + MAX_DIMS] per-parameter facts.")
      .def("side_ranks", &PyWorld::side_ranks, py::arg("side"), "Sorted ranks of one side.")
      .def("first_overlap", &PyWorld::first_overlap, py::arg("side"),
           "Canonical index of the first parameter of a side where one rank holds two overlapping "
           "pieces (global or local space), or -1.")
      .def_property_readonly("op_cols", &PyWorld::op_cols);
}

}  // namespace awex::plan
