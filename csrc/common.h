// Shared assertion helpers for the native core. Errors carry file and line so a failure inside a
// plan or a copy names where it was detected; callers add the parameter, rank and step.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace awex {

// Raised for bad arguments reaching the native core; pybind11 maps it to ValueError.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Raised for failures of the runtime underneath (CUDA, NCCL, the OS); mapped to RuntimeError.
class RuntimeFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

}  // namespace awex

#define AWEX_CHECK_ARG(cond, ...)                                                             \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      throw ::awex::ArgumentError(::awex::concat(__VA_ARGS__, " [", __FILE__, ":", __LINE__, \
                                                 "]"));                                       \
    }                                                                                         \
  } while (0)

#define AWEX_CHECK_RT(cond, ...)                                                                \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      throw ::awex::RuntimeFailure(::awex::concat(__VA_ARGS__, " [", __FILE__, ":", __LINE__, \
                                                  "]"));                                        \
    }                                                                                           \
  } while (0)

// Clones a hot loop for x86-64-v4 (AVX-512) and v3 (AVX2) next to the baseline build, picked at
// load time by the CPU (GCC function multiversioning); a no-op elsewhere.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AWEX_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define AWEX_CPU_CLONES
#endif
