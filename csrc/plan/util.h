// Small helpers shared by the planner's translation units: integer arithmetic, torch.chunk
// arithmetic and the tuple formatting its error messages use (one definition each).
#pragma once

#include <cstdint>
#include <string>

namespace awex::plan {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t gcd(int64_t a, int64_t b) {
  while (b) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Non-empty chunks of torch.chunk(size, n) and their step.
inline void chunking(int64_t size, int64_t n, int64_t& step, int64_t& nonempty) {
  step = size ? ceil_div(size, n) : 0;
  nonempty = step ? ceil_div(size, step) : 0;
}

// "(1, 2)", "(3,)", "()": a tuple as Python prints it, for messages naming shapes and offsets.
inline std::string tuple_str(const int64_t* v, int n) {
  std::string out = "(";
  for (int i = 0; i < n; ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + (n == 1 ? ",)" : ")");
}

inline const char* side_name(int s) { return s == 0 ? "training" : "inference"; }

}  // namespace awex::plan
