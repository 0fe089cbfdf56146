// CUDA twins of quant_cpu.cpp, same semantics, queued on the caller's stream.
//
// block_amax: one CUDA block per touched FP8 block (grid-stride over them); its threads walk the
// block's part of the piece (consecutive threads on consecutive columns, so loads coalesce on a
// row-major piece), keep the max of the magnitude's bits (the integer order of non-negative
// floats is their order, and NaN / inf land above every finite value, so a non-finite block
// gets a non-finite amax, as torch's amax gives it), and reduce it by warp shuffles and shared
// memory. Nothing is reported to the host: the caller checks the amax it asked for.
//
// quantize_blocks: one thread per element: thread x walks one column, the grid's y dimension
// (and a loop) the rows, so a thread computes its column's block index once.
//
// Every float operation is an _rn intrinsic (never contracted into an FMA: nvcc contracts by
// default), and the reciprocal is __frcp_rn, the correctly rounded 1 / s that torch's
// `1.0 / scales` computes.
#include <cuda_runtime.h>

#include <algorithm>

#include "common.h"
#include "cuda_util.h"
#include "quant/quant.h"

namespace awex::quant {
namespace {

constexpr int kAmaxThreads = 256;
constexpr int kQuantThreads = 256;
constexpr int64_t kMaxAmaxBlocks = 65536;
constexpr int64_t kMaxGridY = 65535;

// Magnitude bits of the element at p (float32: 31 bits; bf16 / f16: 15 bits).
__device__ __forceinline__ uint32_t mag_bits(const char* p, int kind) {
  if (kind == copy::kF32) return *reinterpret_cast<const uint32_t*>(p) & 0x7fffffffu;
  return *reinterpret_cast<const uint16_t*>(p) & 0x7fffu;
}

__device__ __forceinline__ float bits_to_f32(uint32_t bits, int kind) {
  if (kind == copy::kF32) return __uint_as_float(bits);
  if (kind == copy::kBF16) return __uint_as_float(bits << 16);
  return __half2float(__ushort_as_half(static_cast<uint16_t>(bits)));
}

// Widening is exact for every number either way; the intrinsics are what c10 uses on the GPU.
__device__ __forceinline__ float load_f32(const char* p, int kind) {
  if (kind == copy::kF32) return *reinterpret_cast<const float*>(p);
  const uint16_t h = *reinterpret_cast<const uint16_t*>(p);
  return kind == copy::kBF16 ? __bfloat162float(__ushort_as_bfloat16(h)) : __half2float(__ushort_as_half(h));
}

__global__ void amax_kernel(Piece p, float* out, int64_t osr, int64_t osc) {
  __shared__ uint32_t warp_max[kAmaxThreads / 32];
  const int64_t nbc = p.block_cols(), total = p.block_rows() * nbc;
  const int esz = p.kind == copy::kF32 ? 4 : 2;
  for (int64_t b = blockIdx.x; b < total; b += gridDim.x) {
    const int64_t i = b / nbc, j = b % nbc;
    const int64_t r_lo = max(int64_t{0}, (p.first_block_row() + i) * p.bn - p.r0);
    const int64_t r_hi = min(p.rows, (p.first_block_row() + i + 1) * p.bn - p.r0);
    const int64_t c_lo = max(int64_t{0}, (p.first_block_col() + j) * p.bk - p.c0);
    const int64_t c_hi = min(p.cols, (p.first_block_col() + j + 1) * p.bk - p.c0);
    const int64_t w = c_hi - c_lo, n = (r_hi - r_lo) * w;
    uint32_t best = 0;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
      const int64_t r = r_lo + e / w, c = c_lo + e % w;
      best = max(best, mag_bits(p.src + (r * p.sr + c * p.sc) * esz, p.kind));
    }
    for (int off = 16; off > 0; off >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 1; k < kAmaxThreads / 32; ++k) best = max(best, warp_max[k]);
      out[i * osr + j * osc] = bits_to_f32(best, p.kind);
    }
    __syncthreads();  // warp_max is reused by the next block of the grid-stride loop
  }
}

__global__ void quantize_kernel(Piece p, const float* scales, int64_t ssr, int64_t ssc, uint8_t* dst,
                                int64_t dsr, int64_t dsc) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= p.cols) return;
  const int esz = p.kind == copy::kF32 ? 4 : 2;
  const int64_t bj = (p.c0 + c) / p.bk;
  int64_t bi = -1;
  float inv = 0.0f;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const int64_t row_block = (p.r0 + r) / p.bn;
    if (row_block != bi) {
      bi = row_block;
      inv = __frcp_rn(scales[bi * ssr + bj * ssc]);
    }
    const float x = load_f32(p.src + (r * p.sr + c * p.sc) * esz, p.kind);
    dst[r * dsr + c * dsc] = f32_to_e4m3fn(mul_rn(x, inv));
  }
}

void check_aligned(const Piece& p) {
  const int esz = p.kind == copy::kF32 ? 4 : 2;
  // A misaligned typed access is a sticky error that ruins the CUDA context (copy_cuda.cu).
  AWEX_CHECK_ARG(reinterpret_cast<uintptr_t>(p.src) % esz == 0, "quantize (CUDA): the piece's data pointer is "
                 "not aligned to its ", esz, "-byte elements");
}

}  // namespace

void block_amax_cuda(const Piece& p, float* out, int64_t osr, int64_t osc, int device, uintptr_t stream) {
  check_piece(p);
  check_aligned(p);
  AWEX_CHECK_ARG(out != nullptr && reinterpret_cast<uintptr_t>(out) % 4 == 0,
                 "block_amax (CUDA): null or misaligned output");
  DeviceGuard guard(device);
  const int64_t blocks = std::min(kMaxAmaxBlocks, p.block_rows() * p.block_cols());
  amax_kernel<<<static_cast<unsigned>(blocks), kAmaxThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      p, out, osr, osc);
  AWEX_CUDA_CHECK(cudaGetLastError());
}

void quantize_blocks_cuda(const Piece& p, const float* scales, int64_t ssr, int64_t ssc, uint8_t* dst,
                          int64_t dsr, int64_t dsc, int device, uintptr_t stream) {
  check_piece(p);
  check_aligned(p);
  AWEX_CHECK_ARG(scales != nullptr && reinterpret_cast<uintptr_t>(scales) % 4 == 0 && dst != nullptr,
                 "quantize_blocks (CUDA): null or misaligned scales, or null destination");
  DeviceGuard guard(device);
  const int64_t col_blocks = (p.cols + kQuantThreads - 1) / kQuantThreads;
  AWEX_CHECK_ARG(col_blocks <= 0x7fffffff, "quantize_blocks (CUDA): ", p.cols, " columns is too many");
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(std::min(kMaxGridY, p.rows)));
  quantize_kernel<<<grid, kQuantThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p, scales, ssr, ssc, dst,
                                                                                       dsr, dsc);
  AWEX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace awex::quant
