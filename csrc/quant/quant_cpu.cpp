// CPU block-FP8 kernels, on the copy path's thread pool.
//
// Work is cut into tasks of one block row x a group of block columns (about kGroupElems
// columns), claimed dynamically by the pool. Both kernels stream each row of a task once, with
// the inner loop over contiguous columns (a piece whose columns are strided but whose rows are
// contiguous, a transposed view, is handled as its transpose, which has the same blocks
// transposed).
//
// amax: the running maximum is kept per column (a vertical, elementwise max that vectorises
// without any horizontal reduction in the hot loop) and folded per block once per block row.
// It is taken over the magnitude's bit pattern, as an unsigned integer: for non-negative
// floats the integer order is the float order, the max of integers vectorises without
// -ffast-math (a float max reduction would not: it is not associative with NaNs), and
// NaN / inf (exponent all ones) come out above every finite value, so one comparison of the
// block's max finds them.
//
// quantize: per block row, the reciprocal of each column's block scale is laid out per column
// once, so the hot loop is one multiply and one conversion per element over the whole group.
#include <algorithm>
#include <vector>

#include "common.h"
#include "copy/thread_pool.h"
#include "quant/quant.h"

namespace awex::quant {
namespace {

using copy::kBF16;
using copy::kF16;
using copy::kF32;

// Columns per task (and per column-max buffer: 16 KiB of uint32, inside L1 with the rows).
constexpr int64_t kGroupElems = 4096;
// Pieces below this many elements run on the calling thread: waking the pool costs more.
constexpr int64_t kSerialElems = 1 << 15;

// --- hot loops: one per dtype, cloned for AVX-512 / AVX2 (AWEX_CPU_CLONES) -------------------

AWEX_CPU_CLONES
void colmax_f32(const uint32_t* __restrict s, uint32_t* __restrict m, int64_t n) {
  for (int64_t c = 0; c < n; ++c) m[c] = std::max(m[c], s[c] & 0x7fffffffu);
}
AWEX_CPU_CLONES
void colmax_16(const uint16_t* __restrict s, uint16_t* __restrict m, int64_t n) {
  // bf16 and f16 alike: the magnitude's bits order as the magnitude does.
  for (int64_t c = 0; c < n; ++c) m[c] = std::max<uint16_t>(m[c], s[c] & 0x7fffu);
}

AWEX_CPU_CLONES
void quant_f32(const float* __restrict s, const float* __restrict inv, uint8_t* __restrict d, int64_t n) {
  for (int64_t c = 0; c < n; ++c) d[c] = f32_to_e4m3fn(s[c] * inv[c]);
}
AWEX_CPU_CLONES
void quant_bf16(const uint16_t* __restrict s, const float* __restrict inv, uint8_t* __restrict d, int64_t n) {
  for (int64_t c = 0; c < n; ++c) d[c] = f32_to_e4m3fn(copy::bf16_to_f32(s[c]) * inv[c]);
}
AWEX_CPU_CLONES
void quant_f16(const uint16_t* __restrict s, const float* __restrict inv, uint8_t* __restrict d, int64_t n) {
  for (int64_t c = 0; c < n; ++c) d[c] = f32_to_e4m3fn(copy::f16_to_f32(s[c]) * inv[c]);
}

int elem_size(int kind) { return kind == kF32 ? 4 : 2; }

// Magnitude bits of element c of a row (any column stride): the strided path's load.
uint32_t mag_bits(const char* row, int kind, int64_t c, int64_t sc) {
  if (kind == kF32) {
    uint32_t u;
    memcpy(&u, row + c * sc * 4, 4);
    return u & 0x7fffffffu;
  }
  uint16_t h;
  memcpy(&h, row + c * sc * 2, 2);
  return h & 0x7fffu;
}

float load_f32(const char* p, int kind) {
  if (kind == kF32) return copy::load_as_f32<kF32>(p);
  if (kind == kBF16) return copy::load_as_f32<kBF16>(p);
  return copy::load_as_f32<kF16>(p);
}

// The magnitude bits' max as a float32 (bf16 / f16 bits widen exactly; NaN stays NaN).
float bits_to_f32(uint32_t bits, int kind) {
  if (kind == kF32) return f32_from_bits(bits);
  if (kind == kBF16) return copy::bf16_to_f32(static_cast<uint16_t>(bits));
  return copy::f16_to_f32(static_cast<uint16_t>(bits));
}

// One task: block row i (of the piece's touched blocks) x block columns [j0, j1).
struct Task {
  int64_t i, j0, j1;
};

// The piece's tasks, and the local row / column range of a touched block row / column.
struct Tiling {
  const Piece& p;
  int64_t nbr, nbc, group;  // touched block rows / cols; block columns per task
  explicit Tiling(const Piece& piece)
      : p(piece), nbr(piece.block_rows()), nbc(piece.block_cols()),
        group(std::max<int64_t>(1, kGroupElems / piece.bk)) {}
  int64_t groups() const { return (nbc + group - 1) / group; }
  int64_t tasks() const { return nbr * groups(); }
  Task task(int64_t t) const {
    const int64_t g = t % groups();
    return {t / groups(), g * group, std::min(nbc, (g + 1) * group)};
  }
  // Local [lo, hi) rows of touched block row i; columns of touched block column j.
  int64_t row_lo(int64_t i) const { return std::max<int64_t>(0, (p.first_block_row() + i) * p.bn - p.r0); }
  int64_t row_hi(int64_t i) const { return std::min(p.rows, (p.first_block_row() + i + 1) * p.bn - p.r0); }
  int64_t col_lo(int64_t j) const { return std::max<int64_t>(0, (p.first_block_col() + j) * p.bk - p.c0); }
  int64_t col_hi(int64_t j) const { return std::min(p.cols, (p.first_block_col() + j + 1) * p.bk - p.c0); }
};

void run_tasks(const Piece& p, const Tiling& tiling, const std::function<void(int)>& fn) {
  const int64_t tasks = tiling.tasks();
  AWEX_CHECK_ARG(tasks <= (int64_t{1} << 30), "quantize: too many blocks (", tasks, " tasks)");
  if (p.rows * p.cols < kSerialElems) {
    for (int64_t t = 0; t < tasks; ++t) fn(static_cast<int>(t));
    return;
  }
  copy::ThreadPool::instance().run(static_cast<int>(tasks), fn);
}

// The problem as the kernels see it: columns contiguous when either orientation has them.
// A transposed view (rows contiguous, columns strided) is its transpose's blocks transposed.
Piece oriented(const Piece& p, bool& transposed) {
  transposed = p.sc != 1 && p.sr == 1 && p.cols > 1;
  if (!transposed) return p;
  Piece t = p;
  std::swap(t.rows, t.cols);
  std::swap(t.sr, t.sc);
  std::swap(t.r0, t.c0);
  std::swap(t.bn, t.bk);
  return t;
}

}  // namespace

void check_piece(const Piece& p) {
  AWEX_CHECK_ARG(p.kind == kF32 || p.kind == kBF16 || p.kind == kF16,
                 "quantize: the piece must be float32, bfloat16 or float16 (kind ", p.kind, ")");
  AWEX_CHECK_ARG(p.rows >= 1 && p.cols >= 1, "quantize: empty piece ", p.rows, "x", p.cols);
  AWEX_CHECK_ARG(p.bn >= 1 && p.bk >= 1, "quantize: block ", p.bn, "x", p.bk, " must be positive");
  AWEX_CHECK_ARG(p.r0 >= 0 && p.c0 >= 0, "quantize: negative offset (", p.r0, ", ", p.c0, ")");
  AWEX_CHECK_ARG(p.src != nullptr, "quantize: null source pointer");
}

int64_t block_amax_cpu(const Piece& piece, float* out, int64_t osr, int64_t osc) {
  check_piece(piece);
  AWEX_CHECK_ARG(out != nullptr, "block_amax: null output pointer");
  bool transposed = false;
  const Piece p = oriented(piece, transposed);
  if (transposed) std::swap(osr, osc);
  const Tiling tiling(p);
  const int esz = elem_size(p.kind);
  // Non-finite flags per touched block (this orientation), scanned in the caller's afterwards.
  std::vector<uint8_t> bad(static_cast<size_t>(tiling.nbr * tiling.nbc), 0);
  const bool contiguous = p.sc == 1;
  run_tasks(p, tiling, [&](int t) {
    const Task task = tiling.task(t);
    const int64_t c_lo = tiling.col_lo(task.j0), c_hi = tiling.col_hi(task.j1 - 1), n = c_hi - c_lo;
    std::vector<uint32_t> m32;
    std::vector<uint16_t> m16;
    if (p.kind == kF32) m32.assign(static_cast<size_t>(n), 0);
    else m16.assign(static_cast<size_t>(n), 0);
    for (int64_t r = tiling.row_lo(task.i); r < tiling.row_hi(task.i); ++r) {
      const char* row = p.src + (r * p.sr + c_lo * p.sc) * esz;
      if (contiguous && p.kind == kF32) {
        colmax_f32(reinterpret_cast<const uint32_t*>(row), m32.data(), n);
      } else if (contiguous) {
        colmax_16(reinterpret_cast<const uint16_t*>(row), m16.data(), n);
      } else {
        for (int64_t c = 0; c < n; ++c) {
          const uint32_t b = mag_bits(row, p.kind, c, p.sc);
          if (p.kind == kF32) m32[c] = std::max(m32[c], b);
          else m16[c] = std::max<uint16_t>(m16[c], static_cast<uint16_t>(b));
        }
      }
    }
    for (int64_t j = task.j0; j < task.j1; ++j) {
      uint32_t best = 0;
      for (int64_t c = tiling.col_lo(j) - c_lo; c < tiling.col_hi(j) - c_lo; ++c)
        best = std::max<uint32_t>(best, p.kind == kF32 ? m32[c] : m16[c]);
      const float amax = bits_to_f32(best, p.kind);
      out[task.i * osr + j * osc] = amax;
      if (!std::isfinite(amax)) bad[task.i * tiling.nbc + j] = 1;
    }
  });
  // First bad block in the caller's row-major order of its own (untransposed) grid.
  const int64_t rows_b = transposed ? tiling.nbc : tiling.nbr, cols_b = transposed ? tiling.nbr : tiling.nbc;
  for (int64_t i = 0; i < rows_b; ++i)
    for (int64_t j = 0; j < cols_b; ++j)
      if (bad[transposed ? j * tiling.nbc + i : i * tiling.nbc + j]) return i * cols_b + j;
  return -1;
}

void quantize_blocks_cpu(const Piece& piece, const float* scales, int64_t ssr, int64_t ssc,
                         uint8_t* dst, int64_t dsr, int64_t dsc) {
  check_piece(piece);
  AWEX_CHECK_ARG(scales != nullptr && dst != nullptr, "quantize_blocks: null scales or destination");
  bool transposed = false;
  const Piece p = oriented(piece, transposed);
  if (transposed) {
    std::swap(ssr, ssc);
    std::swap(dsr, dsc);
  }
  const Tiling tiling(p);
  const int esz = elem_size(p.kind);
  const bool contiguous = p.sc == 1 && dsc == 1;
  run_tasks(p, tiling, [&](int t) {
    const Task task = tiling.task(t);
    const int64_t c_lo = tiling.col_lo(task.j0), c_hi = tiling.col_hi(task.j1 - 1), n = c_hi - c_lo;
    // Per column, the reciprocal of its block's scale: IEEE float32 division, which is what
    // torch's `1.0 / scales` computes (Tensor.__rdiv__ is reciprocal() * 1.0, and ATen's
    // reciprocal divides) on the CPU and the GPU alike.
    std::vector<float> inv(static_cast<size_t>(n));
    const int64_t bi = p.first_block_row() + task.i;
    for (int64_t j = task.j0; j < task.j1; ++j) {
      const float s = scales[bi * ssr + (p.first_block_col() + j) * ssc];
      const float r = 1.0f / s;
      for (int64_t c = tiling.col_lo(j) - c_lo; c < tiling.col_hi(j) - c_lo; ++c) inv[c] = r;
    }
    for (int64_t r = tiling.row_lo(task.i); r < tiling.row_hi(task.i); ++r) {
      const char* row = p.src + (r * p.sr + c_lo * p.sc) * esz;
      uint8_t* out = dst + r * dsr + c_lo * dsc;
      if (contiguous) {
        if (p.kind == kF32) quant_f32(reinterpret_cast<const float*>(row), inv.data(), out, n);
        else if (p.kind == kBF16) quant_bf16(reinterpret_cast<const uint16_t*>(row), inv.data(), out, n);
        else quant_f16(reinterpret_cast<const uint16_t*>(row), inv.data(), out, n);
      } else {
        for (int64_t c = 0; c < n; ++c)
          out[c * dsc] = f32_to_e4m3fn(load_f32(row + c * p.sc * esz, p.kind) * inv[c]);
      }
    }
  });
}

}  // namespace awex::quant
