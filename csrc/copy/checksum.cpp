#include "copy/checksum.h"

#include <algorithm>
#include <atomic>

#include "common.h"
#include "copy/thread_pool.h"

namespace awex::copy {
namespace {

// Sum of the word terms of words [lo, hi): independent per word, so it vectorises (AVX-512's
// 64-bit multiplies) in the cloned builds.
AWEX_CPU_CLONES
uint64_t sum_words(const unsigned char* bytes, int64_t lo, int64_t hi) {
  uint64_t sum = 0;
  for (int64_t i = lo; i < hi; ++i) {
    uint64_t w;
    memcpy(&w, bytes + i * 8, 8);
    sum += word_term(w, static_cast<uint64_t>(i));
  }
  return sum;
}

}  // namespace

uint64_t checksum_cpu(const void* data, int64_t nbytes) {
  AWEX_CHECK_ARG(nbytes >= 0, "checksum of a negative byte count");
  const auto* bytes = static_cast<const unsigned char*>(data);
  const int64_t words = nbytes / 8;
  auto& pool = ThreadPool::instance();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(pool.size(), words >> 16)));
  std::atomic<uint64_t> total{0};
  pool.run(threads, [&](int t) {
    const int64_t lo = words * t / threads, hi = words * (t + 1) / threads;
    total.fetch_add(sum_words(bytes, lo, hi));
  });
  uint64_t tail = 0;
  memcpy(&tail, bytes + words * 8, static_cast<size_t>(nbytes - words * 8));
  return total.load() + word_term(tail, static_cast<uint64_t>(words)) +
         mix64(static_cast<uint64_t>(nbytes));
}

}  // namespace awex::copy
