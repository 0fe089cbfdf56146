// Python face of csrc/quant: raw pointers, dtype codes (csrc/copy/copy.h: kind | itemsize << 8),
// shapes and strides in elements. awex_fast/transfer/fp8.py is the only caller.
#include <pybind11/pybind11.h>

#include "common.h"
#include "quant/quant.h"

namespace py = pybind11;

namespace awex::quant {
namespace {

Piece make_piece(uintptr_t src, int64_t code, int64_t rows, int64_t cols, int64_t sr, int64_t sc, int64_t r0,
                 int64_t c0, int64_t bn, int64_t bk) {
  Piece p;
  p.src = reinterpret_cast<const char*>(src);
  p.kind = copy::code_kind(code);
  const int size = copy::code_size(code);
  AWEX_CHECK_ARG((p.kind == copy::kF32 && size == 4) || ((p.kind == copy::kBF16 || p.kind == copy::kF16) && size == 2),
                 "quantize: the piece must be float32, bfloat16 or float16 (dtype code ", code, ")");
  p.rows = rows;
  p.cols = cols;
  p.sr = sr;
  p.sc = sc;
  p.r0 = r0;
  p.c0 = c0;
  p.bn = bn;
  p.bk = bk;
  check_piece(p);
  return p;
}

int64_t block_amax(uintptr_t src, int64_t code, int64_t rows, int64_t cols, int64_t sr, int64_t sc, int64_t r0,
                   int64_t c0, int64_t bn, int64_t bk, uintptr_t out, int64_t osr, int64_t osc, int device,
                   uintptr_t stream) {
  const Piece p = make_piece(src, code, rows, cols, sr, sc, r0, c0, bn, bk);
  py::gil_scoped_release release;
  if (device < 0) return block_amax_cpu(p, reinterpret_cast<float*>(out), osr, osc);
#if defined(AWEX_FAST_WITH_CUDA)
  block_amax_cuda(p, reinterpret_cast<float*>(out), osr, osc, device, stream);
  return -1;
#else
  (void)stream;
  throw ArgumentError("a CUDA block_amax was asked for but awex_fast was built without CUDA");
#endif
}

void quantize_blocks(uintptr_t src, int64_t code, int64_t rows, int64_t cols, int64_t sr, int64_t sc, int64_t r0,
                     int64_t c0, int64_t bn, int64_t bk, uintptr_t scales, int64_t ssr, int64_t ssc, uintptr_t dst,
                     int64_t dsr, int64_t dsc, int device, uintptr_t stream) {
  const Piece p = make_piece(src, code, rows, cols, sr, sc, r0, c0, bn, bk);
  const auto* s = reinterpret_cast<const float*>(scales);
  auto* d = reinterpret_cast<uint8_t*>(dst);
  py::gil_scoped_release release;
  if (device < 0) return quantize_blocks_cpu(p, s, ssr, ssc, d, dsr, dsc);
#if defined(AWEX_FAST_WITH_CUDA)
  quantize_blocks_cuda(p, s, ssr, ssc, d, dsr, dsc, device, stream);
#else
  (void)stream;
  throw ArgumentError("a CUDA quantize_blocks was asked for but awex_fast was built without CUDA");
#endif
}

}  // namespace

void register_apis(py::module_& m) {
  auto sub = m.def_submodule("quant", "block-FP8 quantization kernels (see csrc/quant/quant.h)");
  sub.def("block_amax", &block_amax, py::arg("src"), py::arg("code"), py::arg("rows"), py::arg("cols"),
          py::arg("sr"), py::arg("sc"), py::arg("r0"), py::arg("c0"), py::arg("bn"), py::arg("bk"), py::arg("out"),
          py::arg("osr"), py::arg("osc"), py::arg("device") = -1, py::arg("stream") = 0,
          "Per-block float32 amax of |x| over the blocks a strided 2-D piece at (r0, c0) touches, into "
          "out[i * osr + j * osc]. CPU: returns the row-major index of the first block holding a non-finite "
          "value, or -1. CUDA (device >= 0): queued on stream, returns -1; non-finite blocks show in out.");
  sub.def("quantize_blocks", &quantize_blocks, py::arg("src"), py::arg("code"), py::arg("rows"), py::arg("cols"),
          py::arg("sr"), py::arg("sc"), py::arg("r0"), py::arg("c0"), py::arg("bn"), py::arg("bk"),
          py::arg("scales"), py::arg("ssr"), py::arg("ssc"), py::arg("dst"), py::arg("dsr"), py::arg("dsc"),
          py::arg("device") = -1, py::arg("stream") = 0,
          "e4m3fn bytes of x * (1 / scale of its block) in float32, written to dst[r * dsr + c * dsc] "
          "(scales: the float32 grid from block (0, 0), scales[bi * ssr + bj * ssc]).");
}

}  // namespace awex::quant
