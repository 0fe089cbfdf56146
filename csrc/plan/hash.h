// Two independent 64-bit streaming hashes over int64 words, used for the plan digest.
//
// Why not SHA-256: the digest covers the whole canonical metadata (millions of words for a
// 1T-parameter MoE) and every rank computes it at start-up; two unrelated 64-bit lanes (an
// xxHash64-style round and a MurmurHash3-style round, different constants, different seeds)
// are ~10x faster and make an accidental collision between two different metadata sets
// vanishingly unlikely. The digest proves agreement between cooperating ranks; it is not meant
// to resist an adversary.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace awex::plan {

class Hash128 {
 public:
  void add(uint64_t w) {
    a_ += w * 0xC2B2AE3D27D4EB4FULL;
    a_ = rotl(a_, 31) * 0x9E3779B185EBCA87ULL;
    uint64_t k = w * 0x87C37B91114253D5ULL;
    k = rotl(k, 33) * 0x4CF5AD432745937FULL;
    b_ ^= k;
    b_ = rotl(b_, 27) * 5 + 0x52DCE729ULL;
    ++n_;
  }
  void add_signed(int64_t w) { add(static_cast<uint64_t>(w)); }
  void add_bytes(const std::string& s) {
    add(s.size());
    uint64_t w = 0;
    int k = 0;
    for (unsigned char c : s) {
      w |= static_cast<uint64_t>(c) << (8 * k);
      if (++k == 8) {
        add(w);
        w = 0;
        k = 0;
      }
    }
    if (k) add(w);
  }
  std::string hex() const {
    char out[33];
    std::snprintf(out, sizeof(out), "%016llx%016llx",
                  static_cast<unsigned long long>(fmix(a_ ^ n_)),
                  static_cast<unsigned long long>(fmix(b_ ^ (n_ * 0x9E3779B97F4A7C15ULL))));
    return out;
  }
  uint64_t lane_a() const { return fmix(a_ ^ n_); }
  uint64_t lane_b() const { return fmix(b_ ^ (n_ * 0x9E3779B97F4A7C15ULL)); }

  static uint64_t fmix(uint64_t h) {  // MurmurHash3 finaliser
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h;
  }

 private:
  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  uint64_t a_ = 0x27D4EB2F165667C5ULL;
  uint64_t b_ = 0x9747B28C5A3F1D2BULL;
  uint64_t n_ = 0;
};

}  // namespace awex::plan
