// CUDA twin of copy_cpu: the whole descriptor list in one kernel launch on the caller's stream.
//
// Host side: the same normalize() as the CPU path (bitwise copies widened to 16-byte units where
// addresses, strides and extents allow), then every box is cut into chunks of kChunk units and
// one block handles one chunk (grid-stride over chunks, grid sized by bytes). The box table and
// its chunk prefix travel to the device in one stream-ordered allocation.
#include <cuda_runtime.h>

#include <algorithm>

#include "common.h"
#include "copy/checksum.h"
#include "copy/copy.h"
#include "cuda_util.h"

namespace awex::copy {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = kThreads * 16;  // units per block iteration
constexpr int64_t kMaxBlocks = 8192;

// normalize() checks alignment only when it widens a bitwise copy; the element size itself is
// assumed aligned. A misaligned typed access on the GPU is a sticky error that ruins the whole
// CUDA context (every later torch call fails), so check here and fall back to bytes.
template <typename T>
__device__ __forceinline__ void move(const char* s, char* d) {
  if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & (sizeof(T) - 1)) == 0) {
    *reinterpret_cast<T*>(d) = *reinterpret_cast<const T*>(s);
  } else {
    for (size_t k = 0; k < sizeof(T); ++k) d[k] = s[k];
  }
}

// Element access for the casting path. memcpy from a char* compiles to one byte load/store per
// byte (ld.u8/st.u8 in the PTX), 4x the memory instructions for float32; elements are
// naturally aligned in practice (torch tensors, wire offsets that are multiples of the
// itemsize), so use one typed access then and keep memcpy only for a misaligned address.
template <typename T>
__device__ __forceinline__ T load_elem(const char* p) {
  if ((reinterpret_cast<uintptr_t>(p) & (sizeof(T) - 1)) == 0) return *reinterpret_cast<const T*>(p);
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
__device__ __forceinline__ void store_elem(char* p, T v) {
  if ((reinterpret_cast<uintptr_t>(p) & (sizeof(T) - 1)) == 0) *reinterpret_cast<T*>(p) = v;
  else memcpy(p, &v, sizeof(T));
}

// 16-bit floats widen through the intrinsics c10::Half / c10::BFloat16 use on the GPU
// (__half2float; __bfloat162float, which is cvt.f32.bf16 on sm_90), so that what torch's .to()
// does on CUDA, NaN bit patterns included, is what this kernel does. Numbers widen exactly
// either way; copy.h's portable bit tricks are kept for the CPU path. Narrowing uses copy.h's
// f32_to_bf16 / f32_to_f16, which already pick the intrinsics torch uses on the device.
__device__ __forceinline__ float load_f32(int kind, const char* s) {
  if (kind == kF32) return load_elem<float>(s);
  const uint16_t h = load_elem<uint16_t>(s);
  return kind == kBF16 ? __bfloat162float(__ushort_as_bfloat16(h)) : __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ void store_f32(int kind, char* d, float v) {
  if (kind == kF32) store_elem<float>(d, v);
  else store_elem<uint16_t>(d, kind == kBF16 ? f32_to_bf16(v) : f32_to_f16(v));
}

__device__ __forceinline__ void copy_element(const Box& b, int64_t e) {
  // Unravel e over the coalesced shape; 32-bit arithmetic when the box allows (the common case).
  int64_t soff = 0, doff = 0;
  if (b.numel <= 0xffffffffll) {
    uint32_t rest = static_cast<uint32_t>(e);
    for (int d = b.ndim - 1; d >= 0; --d) {
      const uint32_t n = static_cast<uint32_t>(b.shape[d]);
      const uint32_t i = d == 0 ? rest : rest % n;
      rest = d == 0 ? 0 : rest / n;
      soff += static_cast<int64_t>(i) * b.src_stride[d];
      doff += static_cast<int64_t>(i) * b.dst_stride[d];
    }
  } else {
    int64_t rest = e;
    for (int d = b.ndim - 1; d >= 0; --d) {
      const int64_t i = d == 0 ? rest : rest % b.shape[d];
      rest = d == 0 ? 0 : rest / b.shape[d];
      soff += i * b.src_stride[d];
      doff += i * b.dst_stride[d];
    }
  }
  const char* s = b.src + soff * b.src_size;
  char* d = b.dst + doff * b.dst_size;
  if (b.src_kind == kRaw) {
    switch (b.src_size) {
      case 16: return move<uint4>(s, d);
      case 8: return move<uint64_t>(s, d);
      case 4: return move<uint32_t>(s, d);
      case 2: return move<uint16_t>(s, d);
      case 1: return move<uint8_t>(s, d);
      default:
        for (int k = 0; k < b.src_size; ++k) d[k] = s[k];
        return;
    }
  }
  store_f32(b.dst_kind, d, load_f32(b.src_kind, s));
}

// boxes: [nboxes]; chunk_start: [nboxes + 1] prefix of chunks per box.
__global__ void copy_kernel(const Box* boxes, const int64_t* chunk_start, int nboxes) {
  __shared__ Box box;
  __shared__ int64_t first_chunk;
  const int64_t total = chunk_start[nboxes];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    if (threadIdx.x == 0) {
      int lo = 0, hi = nboxes - 1;  // last box whose first chunk is <= c
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (chunk_start[mid] <= c) lo = mid;
        else hi = mid - 1;
      }
      box = boxes[lo];
      first_chunk = chunk_start[lo];
    }
    __syncthreads();
    const int64_t e0 = (c - first_chunk) * kChunk;
    const int64_t e1 = min(box.numel, e0 + kChunk);
    for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) copy_element(box, e);
    __syncthreads();
  }
}

__global__ void checksum_kernel(const uint64_t* words, int64_t n, unsigned long long* out) {
  uint64_t sum = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    sum += word_term(words[i], static_cast<uint64_t>(i));
  atomicAdd(out, static_cast<unsigned long long>(sum));
}

}  // namespace

void copy_cuda(const std::vector<Box>& boxes, int device, uintptr_t stream_handle) {
  if (boxes.empty()) return;
  DeviceGuard guard(device);  // the kernel runs on the tensors' device, not the caller's current one
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const size_t n = boxes.size();
  std::vector<int64_t> chunk_start(n + 1, 0);
  for (size_t i = 0; i < n; ++i)
    chunk_start[i + 1] = chunk_start[i] + (boxes[i].numel + kChunk - 1) / kChunk;
  const size_t box_bytes = n * sizeof(Box);
  const size_t table_bytes = box_bytes + chunk_start.size() * sizeof(int64_t);
  // One host staging area so the upload is a single copy.
  std::vector<char> host(table_bytes);
  memcpy(host.data(), boxes.data(), box_bytes);
  memcpy(host.data() + box_bytes, chunk_start.data(), chunk_start.size() * sizeof(int64_t));
  void* table = nullptr;
  AWEX_CUDA_CHECK(cudaMallocAsync(&table, table_bytes, stream));
  // Pageable source: the call returns only once the bytes are staged, so `host` may die after.
  AWEX_CUDA_CHECK(cudaMemcpyAsync(table, host.data(), table_bytes, cudaMemcpyHostToDevice, stream));
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, chunk_start[n]);
  copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const Box*>(table),
      reinterpret_cast<const int64_t*>(static_cast<char*>(table) + box_bytes), static_cast<int>(n));
  AWEX_CUDA_CHECK(cudaGetLastError());
  AWEX_CUDA_CHECK(cudaFreeAsync(table, stream));
}

uint64_t checksum_cuda(const void* data, int64_t nbytes, int device, uintptr_t stream_handle) {
  AWEX_CHECK_ARG(nbytes >= 0, "checksum of a negative byte count");
  DeviceGuard guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int64_t words = nbytes / 8;
  unsigned long long* acc = nullptr;
  AWEX_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&acc), sizeof(*acc), stream));
  AWEX_CUDA_CHECK(cudaMemsetAsync(acc, 0, sizeof(*acc), stream));
  if (words > 0) {
    const int64_t blocks = std::min<int64_t>(1024, (words + kThreads - 1) / kThreads);
    checksum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const uint64_t*>(data), words, acc);
    AWEX_CUDA_CHECK(cudaGetLastError());
  }
  unsigned long long sum = 0;
  uint64_t tail = 0;
  const int64_t tail_bytes = nbytes - words * 8;
  AWEX_CUDA_CHECK(cudaMemcpyAsync(&sum, acc, sizeof(sum), cudaMemcpyDeviceToHost, stream));
  if (tail_bytes > 0)
    AWEX_CUDA_CHECK(cudaMemcpyAsync(&tail, static_cast<const char*>(data) + words * 8,
                                    static_cast<size_t>(tail_bytes), cudaMemcpyDeviceToHost, stream));
  AWEX_CUDA_CHECK(cudaFreeAsync(acc, stream));
  AWEX_CUDA_CHECK(cudaStreamSynchronize(stream));
  return static_cast<uint64_t>(sum) + word_term(tail, static_cast<uint64_t>(words)) +
         mix64(static_cast<uint64_t>(nbytes));
}

}  // namespace awex::copy
