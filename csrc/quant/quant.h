// Block-FP8 quantization kernels (vLLM's scheme, see awex_fast/transfer/fp8.py): per block
// [bn, bk] of a 2-D tensor, the largest magnitude (block_amax), and the e4m3fn bytes of every
// element times the reciprocal of its block's scale (quantize_blocks).
//
// A trainer rank holds pieces of each weight (FSDP row shards, TP column shards), so both
// kernels take a strided 2-D piece plus its offset (r0, c0) inside the full tensor: block
// indices are global, a piece may start or end inside a block, and only the blocks the piece
// touches are visited. Python hands over raw pointers, dtype codes (csrc/copy/copy.h's kinds),
// shapes and strides in elements; the native side never sees torch.
#pragma once

#include <cstdint>

#include "copy/copy.h"

namespace awex::quant {

using copy::f32_bits;
using copy::f32_from_bits;

// One 2-D strided piece and its place in the block grid of the full tensor.
struct Piece {
  const char* src = nullptr;
  int kind = 0;              // copy::kF32 / kBF16 / kF16
  int64_t rows = 0, cols = 0;
  int64_t sr = 0, sc = 0;    // strides in elements
  int64_t r0 = 0, c0 = 0;    // offset of the piece's element (0, 0) in the full tensor
  int64_t bn = 0, bk = 0;    // block shape
  AWEX_HD int64_t first_block_row() const { return r0 / bn; }
  AWEX_HD int64_t first_block_col() const { return c0 / bk; }
  AWEX_HD int64_t block_rows() const { return (r0 + rows - 1) / bn - r0 / bn + 1; }
  AWEX_HD int64_t block_cols() const { return (c0 + cols - 1) / bk - c0 / bk + 1; }
};

// Throws ArgumentError unless `p` is a quantizable piece (float kind, positive sizes and block).
void check_piece(const Piece& p);

// Writes the float32 amax of |x| over the part of each block the piece holds into
// out[i * osr + j * osc] for i < block_rows(), j < block_cols() (block (first_block_row() + i,
// first_block_col() + j)). A block holding a NaN or an infinity gets a non-finite amax; the
// return value is the row-major index i * block_cols() + j of the first such block, or -1.
int64_t block_amax_cpu(const Piece& p, float* out, int64_t osr, int64_t osc);

// dst[r * dsr + c * dsc] = e4m3fn(x[r, c] * (1 / scale of its block)), in float32 with round to
// nearest even, bit for bit torch's `(x.float() * (1.0 / scales)).to(torch.float8_e4m3fn)`.
// `scales` is the float32 grid of the full tensor (or a part of it starting at block (0, 0)),
// indexed scales[bi * ssr + bj * ssc] by global block.
void quantize_blocks_cpu(const Piece& p, const float* scales, int64_t ssr, int64_t ssc,
                         uint8_t* dst, int64_t dsr, int64_t dsc);

#if defined(AWEX_FAST_WITH_CUDA)
// CUDA twins, queued on `stream` (a cudaStream_t of `device`, as an integer) with `device`
// current during the call. block_amax_cuda reports nothing: a non-finite block shows as a
// non-finite amax in `out` (device memory), which the caller checks.
void block_amax_cuda(const Piece& p, float* out, int64_t osr, int64_t osc, int device, uintptr_t stream);
void quantize_blocks_cuda(const Piece& p, const float* scales, int64_t ssr, int64_t ssc, uint8_t* dst,
                          int64_t dsr, int64_t dsc, int device, uintptr_t stream);
#endif

// --- float32 -> float8_e4m3fn, bit for bit torch's CPU .to(torch.float8_e4m3fn) -------------
//
// The same function as c10's fp8e4m3fn_from_fp32_value (torch/headeronly/util/Float8_e4m3fn.h,
// C10_HOST_DEVICE: torch's CPU and CUDA casts both use it), rewritten without branches.
// Measured on torch 2.13 (tests/transfer/test_fp8_native.py checks it over all 2^16 bf16
// values and a large sample of every float32 class): round to nearest even; every finite value
// at or above 448 in magnitude, and +-inf, saturates to +-448 (0x7e / 0xfe; e4m3fn has no
// infinity, and 0x7f is its NaN); NaN -> 0x7f with the input's sign; -0.0 -> 0x80; results
// below 2^-6 are e4m3 subnormals (units of 2^-9), inputs below 2^-10 give +-0.
//
// Branch-free (selects only) so the CPU loops vectorise. The float add of the subnormal path
// must not be fused with the multiply before it: the CPU file is built with -ffp-contract=off,
// and device code uses the _rn intrinsics, which are never contracted.
AWEX_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
AWEX_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

AWEX_HD uint8_t f32_to_e4m3fn(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // |f| < 2^-6 (e4m3's smallest normal): adding 2^14, whose ulp is 2^-9 (e4m3's subnormal
  // step), makes the FPU round to nearest even at exactly that step; the low bits are the code.
  constexpr uint32_t kDenormMagic = 141u << 23;  // 2^14
  const uint32_t sub = f32_bits(add_rn(f32_from_bits(a), f32_from_bits(kDenormMagic))) - kDenormMagic;
  // Normal: rebias the exponent (127 -> 7) and round the 20 dropped mantissa bits to nearest
  // even (add 0x7ffff plus the kept lsb); anything that rounds past 448 saturates to 0x7e.
  const uint32_t rounded = (a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  const uint32_t normal = rounded < 0x7eu ? rounded : 0x7eu;
  uint32_t r = a < (121u << 23) ? sub : normal;
  r = a > 0x7f800000u ? 0x7fu : r;
  return static_cast<uint8_t>(r | sign);
}

}  // namespace awex::quant
