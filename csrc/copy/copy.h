// Batched strided copy: the hot path of every weight update.
//
// The sender gathers many strided boxes (slices of parameters) into one contiguous bucket, the
// receiver scatters a bucket into many strided boxes of its parameters. Both are "copy this list
// of boxes", so there is one primitive: a list of descriptors, each naming a source box and a
// destination box of the same shape, possibly of different float dtypes (cast on the fly).
//
// Python builds the descriptors from torch tensors (pointers, shapes, strides) and hands them over
// as one int64 array; the native side never sees torch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define AWEX_HD __host__ __device__ __forceinline__
#else
#define AWEX_HD inline
#endif

namespace awex::copy {

constexpr int kMaxDims = 6;

// Descriptor layout, one row of kDescWords int64 per box:
//   [0] src pointer  [1] dst pointer  [2] ndim  [3] src dtype code  [4] dst dtype code
//   [5 .. 5+kMaxDims)            shape
//   [11 .. 11+kMaxDims)          src strides, in src elements
//   [17 .. 17+kMaxDims)          dst strides, in dst elements
constexpr int kDescWords = 5 + 3 * kMaxDims;
constexpr int kShapeAt = 5;
constexpr int kSrcStrideAt = kShapeAt + kMaxDims;
constexpr int kDstStrideAt = kSrcStrideAt + kMaxDims;

// Dtype code = kind | (itemsize << 8). Equal codes copy bitwise whatever the kind; different
// codes must both be float kinds and are cast through float32 with round-to-nearest-even.
enum Kind : int { kRaw = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };
AWEX_HD int code_kind(int64_t code) { return static_cast<int>(code & 0xff); }
AWEX_HD int code_size(int64_t code) { return static_cast<int>((code >> 8) & 0xff); }
AWEX_HD bool is_float_kind(int kind) { return kind == kF32 || kind == kBF16 || kind == kF16; }

// The dtypes this core casts among, by torch name, with their kind: the one list both the
// copy layer (awex_fast.copy, which codes dtypes) and the planner (which refuses at plan time a
// dtype pair no copy can do) read, exposed to Python as copy.CAST_DTYPES. Every other dtype is
// copied bitwise, and only to itself.
struct CastDtype {
  const char* name;
  Kind kind;
};
constexpr CastDtype kCastDtypes[] = {{"float32", kF32}, {"bfloat16", kBF16}, {"float16", kF16}};

// One box after validation and dimension coalescing (what both the CPU and CUDA paths execute).
// [ndim] shape / strides, innermost last; strides in units of `unit` bytes when raw (same-dtype
// copies are widened to the largest aligned unit), in elements when casting.
struct Box {
  const char* src;
  char* dst;
  int ndim;
  int src_kind, dst_kind;  // kRaw for a bitwise copy
  int src_size, dst_size;  // bytes per element (unit) on each side
  int64_t shape[kMaxDims];
  int64_t src_stride[kMaxDims];
  int64_t dst_stride[kMaxDims];
  int64_t numel;
};

// Parse, validate and coalesce `n` descriptors. Throws ArgumentError naming the box index.
// `max_unit` caps the widening of bitwise copies (16 for the CUDA kernel's uint4 accesses; the
// CPU path uses memcpy for contiguous runs and gains nothing beyond 8).
std::vector<Box> normalize(const int64_t* desc, int64_t n, int max_unit);

// Index pair (i, j) of two descriptors whose destination boxes share a byte (i == j when one box
// overlaps itself, e.g. a stride-0 dimension), or (-1, -1) when all destinations are disjoint.
// Spans are compared first; only boxes whose spans meet are checked run by run.
std::pair<int64_t, int64_t> find_dst_overlap(const int64_t* desc, int64_t n);

// Copies on the CPU with the shared thread pool (the calling thread takes part). Work is split by
// bytes into slices claimed dynamically, not by box count, so one huge box and many tiny ones
// both use every thread. `streaming`: the destinations are not read again soon (received
// weights), so long contiguous runs bypass the caches with non-temporal stores.
void copy_cpu(const std::vector<Box>& boxes, bool streaming = false);

// Threads used by copy_cpu (default: the CPUs this process may run on).
void set_num_threads(int n);
int num_threads();

#if defined(AWEX_FAST_WITH_CUDA)
// One kernel launch for the whole list on `stream` (a cudaStream_t of `device`, as an integer),
// with `device` current during the call.
void copy_cuda(const std::vector<Box>& boxes, int device, uintptr_t stream);
#endif

// --- float conversions, bit-identical to torch (c10::BFloat16 / c10::Half) ------------------

AWEX_HD uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
AWEX_HD float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

AWEX_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest even. NaN handling follows what torch's .to() does on each device: its CPU
// kernels (ATen's vectorised cvtfp32_bf16) write 0xffff for every NaN; on sm_80+ c10::BFloat16
// uses the __float2bfloat16 intrinsic (canonical 0x7fff).
AWEX_HD uint16_t f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  // Branch-free (a select, not a branch) so the CPU loops vectorise.
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0xffffu : rounded);
#endif
}

// IEEE half <-> float by the FP16 library's branch-free bit tricks (what c10::Half uses on CPU).
AWEX_HD float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t cutoff = 1u << 27;
  return f32_from_bits(sign | (two_w < cutoff ? f32_bits(denormalized) : f32_bits(normalized)));
}

// On the CPU, NaNs keep their sign and top payload bits as x86's F16C conversion (what torch's
// vectorised CPU cast uses) does; on the GPU, the __float2half_rn intrinsic c10::Half uses.
AWEX_HD uint16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

template <int K>
AWEX_HD float load_as_f32(const char* p) {
  if constexpr (K == kF32) {
    float v;
    memcpy(&v, p, 4);
    return v;
  } else {
    uint16_t h;
    memcpy(&h, p, 2);
    if constexpr (K == kBF16) return bf16_to_f32(h);
    else return f16_to_f32(h);
  }
}

template <int K>
AWEX_HD void store_from_f32(char* p, float v) {
  if constexpr (K == kF32) {
    memcpy(p, &v, 4);
  } else {
    const uint16_t h = (K == kBF16) ? f32_to_bf16(v) : f32_to_f16(v);
    memcpy(p, &h, 2);
  }
}

}  // namespace awex::copy
