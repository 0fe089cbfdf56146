// Bucket integrity checksum (the executor's verify=True). Positional and order-independent in
// how it is reduced: the sum over 8-byte words of mix(word, index), so threads and CUDA blocks
// can each add their share in any order and get the same 64-bit value on both sides of a wire.
#pragma once

#include <cstdint>

#include "copy/copy.h"

namespace awex::copy {

AWEX_HD uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

AWEX_HD uint64_t word_term(uint64_t word, uint64_t index) {
  return mix64(word ^ mix64(index + 0x9e3779b97f4a7c15ull));
}

uint64_t checksum_cpu(const void* data, int64_t nbytes);
#if defined(AWEX_FAST_WITH_CUDA)
uint64_t checksum_cuda(const void* data, int64_t nbytes, int device, uintptr_t stream);
#endif

}  // namespace awex::copy
