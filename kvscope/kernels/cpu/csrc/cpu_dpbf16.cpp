// A decode step's bf16 linear layers with AVX-512 BF16 (vdpbf16ps), reading the weight oneDNN packed in place:
// cpu_amx.cpp's counterpart for CPUs with avx512_bf16 and no AMX (AMD Zen 4 and 5, Intel Cooper Lake).
//
// At a decode step's few rows a GEMM should run at the memory's read bandwidth. oneDNN's packed call does not at
// these shapes: on a 2-core Zen 5 it streamed Qwen3-0.6B's decode weights (1.19 GB with the lm_head) at 19-23
// GB/s at 1-8 rows, where a copy reads 26-43 GB/s (benchmarks/amx_linear.py --kernel dpbf16). This loop walks a panel
// of 64 output columns through K in chunks of 16 KiB of weight, each chunk in L1 while every group of 6 rows of
// x multiplies it, so each weight byte leaves memory once per call. From about 12 rows both are bound by
// vdpbf16ps itself (about one a cycle), and cpu_linear.py leaves those rows to oneDNN.
//
// The weight is the one oneDNN already holds: on these CPUs oneDNN lays a bf16 [N, K] weight out as
// [N/64][K/2][64 n][2 k], so one 64-byte load is 16 output columns' next pair of k, as vdpbf16ps takes them.
// cpu_linear.py checks, for every weight shape, that its packed bytes are exactly this layout of the dense
// weight (kvscope::dpbf16_blocks_match) before using this kernel; no second copy of the weight is made.
// oneDNN adds K in blocks (block_k values each, in order, a pair at a time), each block's sum started from zero
// and then added to the output in float32; this loop does the same with the caller's block_k, which
// cpu_linear.use_dpbf16 finds per weight shape (oneDNN's block depends on the shape and on one row or more), then
// rounds once to bf16 (the bias, if any, added in float32 first): the same bits as oneDNN's call.
//
// Registered as kvscope::dpbf16_linear and kvscope::dpbf16_blocks_match; kvscope::dpbf16_built says whether
// this build has the instructions (-march=native on a CPU with avx512_bf16).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "onednn_packed.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVSCOPE_DPBF16 1
#include <immintrin.h>
#endif

namespace {

using at::Tensor;

constexpr int64_t kPanel = 64;           // output columns per panel of the layout: four vectors of 16 floats
constexpr int64_t kPairElems = 2 * kPanel;  // one k-pair of a panel: 128 bf16, 256 bytes
constexpr int64_t kChunkPairs = 64;      // k-pairs of weight per chunk: 16 KiB, kept in L1 across the row groups
constexpr int64_t kGroupRows = 6;        // rows of x per pass: 24 accumulators, 4 weight vectors, 1 broadcast

using kvscope_onednn::onednn_data;
using kvscope_onednn::onednn_nbytes;

std::pair<int64_t, int64_t> checked_shape(const Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn() && packed.dim() == 2 && packed.scalar_type() == at::kBFloat16,
              "dpbf16: the weight must be a bf16 [N, K] packed by oneDNN (cpu_linear.py)");
  const int64_t n = packed.size(0), k = packed.size(1);
  TORCH_CHECK(n % kPanel == 0 && k % 2 == 0 && onednn_nbytes(packed) == n * k * 2,
              "dpbf16: a [", n, ", ", k, "] weight is not held as whole panels of 64 columns");
  return {n, k};
}

bool dpbf16_built() {
#if defined(KVSCOPE_DPBF16)
  return true;
#else
  return false;
#endif
}

// Whether packed's bytes are dense [N, K] laid out as [N/64][K/2][64][2], exactly.
bool dpbf16_blocks_match(const Tensor& packed, const Tensor& dense) {
  const auto [n, k] = checked_shape(packed);
  return kvscope_onednn::pair_blocks_match("dpbf16_blocks_match", packed, dense, n, k, kPanel, 2);
}

#if defined(KVSCOPE_DPBF16)
// acc[r][0..64) += x[r] . the panel's columns over `pairs` k-pairs from k-pair `kp0`, for R rows of x (row
// stride k); w: the chunk's first k-pair. The accumulators live in registers through the chunk.
template <int R>
inline void rows_by_chunk(const uint16_t* x, int64_t k, int64_t kp0, const uint16_t* w, int64_t pairs, float* acc) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) c[r][j] = _mm512_loadu_ps(acc + r * kPanel + 16 * j);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * kPairElems;
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, x + r * k + 2 * (kp0 + p), sizeof two);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(two);
      for (int j = 0; j < 4; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * kPanel + 16 * j, c[r][j]);
}

using RowsFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*);
constexpr RowsFn kRowsFns[kGroupRows + 1] = {nullptr, rows_by_chunk<1>, rows_by_chunk<2>, rows_by_chunk<3>,
                                             rows_by_chunk<4>, rows_by_chunk<5>, rows_by_chunk<6>};
#endif

Tensor dpbf16_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t block_k) {
  const auto [n, k] = checked_shape(packed);
  TORCH_CHECK(dpbf16_built(), "dpbf16_linear: this build has no AVX-512 BF16 (kvscope::dpbf16_built() is false)");
  const auto call = kvscope_onednn::linear_call("dpbf16_linear", x, n, k, bias);
  TORCH_CHECK(block_k > 0 && block_k % 2 == 0, "dpbf16_linear: block_k must be a positive even number");
  const int64_t m = call.m;
  if (m == 0) return call.out;
#if defined(KVSCOPE_DPBF16)
  const uint16_t* w = onednn_data(packed);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(call.x.data_ptr());
  c10::BFloat16* o = call.out.data_ptr<c10::BFloat16>();
  const float* bp = call.bias.has_value() ? call.bias->data_ptr<float>() : nullptr;
  const int64_t pairs_all = k / 2, sum_pairs = block_k / 2;
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(m * kPanel)), part(acc.size());
    for (int64_t panel = begin; panel < end; ++panel) {
      const uint16_t* wp = w + panel * pairs_all * kPairElems;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t sum0 = 0; sum0 < pairs_all; sum0 += sum_pairs) {
        std::fill(part.begin(), part.end(), 0.f);
        // one of oneDNN's K blocks, summed from zero in chunks that stay in L1, then added to the output
        for (int64_t kp0 = sum0; kp0 < std::min(pairs_all, sum0 + sum_pairs); kp0 += kChunkPairs) {
          const int64_t pairs = std::min({kChunkPairs, pairs_all - kp0, sum0 + sum_pairs - kp0});
          for (int64_t r0 = 0; r0 < m; r0 += kGroupRows) {
            const int64_t rows = std::min(kGroupRows, m - r0);
            kRowsFns[rows](xs + r0 * k, k, kp0, wp + kp0 * kPairElems, pairs, part.data() + r0 * kPanel);
          }
        }
        for (size_t i = 0; i < acc.size(); ++i) acc[i] += part[i];
      }
      for (int64_t r = 0; r < m; ++r) {
        c10::BFloat16* dst = o + r * n + panel * kPanel;
        const float* a = acc.data() + r * kPanel;
        for (int64_t j = 0; j < kPanel; ++j) dst[j] = c10::BFloat16(bp ? a[j] + bp[panel * kPanel + j] : a[j]);
      }
    }
  });
#endif
  return call.out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("dpbf16_built() -> bool", &dpbf16_built);
  m.def("dpbf16_linear(Tensor x, Tensor packed, Tensor? bias, int block_k) -> Tensor");
  m.def("dpbf16_blocks_match(Tensor packed, Tensor dense) -> bool");
}

// The packed weight is a oneDNN tensor (dispatch key MkldnnCPU), which outranks CPU in dispatch.
TORCH_LIBRARY_IMPL(kvscope, MkldnnCPU, m) {
  m.impl("dpbf16_linear", &dpbf16_linear);
  m.impl("dpbf16_blocks_match", &dpbf16_blocks_match);
}
