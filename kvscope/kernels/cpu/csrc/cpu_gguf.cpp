// Linear layers over a GGUF file's own quantized blocks: y = x W^T + b, with W never made dense.
//
// A one-token decode step reads every weight once, so its time is the weights' bytes over the
// memory bandwidth. SmolLM2's linear layers in bf16 are 269 MB; the same layers as the GGUF's
// Q4_1 blocks (and its Q8_0 embedding as the tied lm_head) are 97 MB. Here each block of 32
// weights is widened in registers as it is read: to the float32 value gguf-py's dequantizer
// gives (what transformers loads), rounded to the activations' dtype where that is bf16 (so the
// weights are bit for bit the ones a dequantized bf16 model holds), then multiplied into float32
// accumulators. Only the summation order differs from a dense GEMM.
//
// A weight repacked 16 rows at a time (the x16 layout, types kX16 + 2, 3 and 8; see x16_line) is
// multiplied by bf16 x without widening to the rounded values: its file's exact weights, 16 outputs
// to a vector, in about a third (4-bit) or a half (Q8_0) of the instructions a block.
//
// Up to kGemvMaxRows rows of x are multiplied block by block (kRowTile at a time, each block's
// weights widened once per tile); a longer input (a prefill chunk) has the weight widened whole
// into x's dtype once and multiplied by ATen's GEMM, where arithmetic, not bytes, is the cost.
//
// The file's own blocks are multiplied by AVX-512 loops, AVX2 + FMA + F16C loops (an AVX2-only CPU such as a
// Zen 2/3 EPYC: 97 MB a token instead of float32's 538) or plain C++, the widest the build targets by default.
//
// Registered as kvscope::gguf_linear, kvscope::gguf_dequantize, kvscope::gguf_x16 (whether the x16 kernel is
// built here), kvscope::gguf_paths (the loops this CPU runs) and kvscope::gguf_linear_on (gguf_linear on named
// loops); kvscope/kernels/cpu/gguf_linear.py holds the torch reference of both, the block layouts (from ggml's
// ggml-common.h) and the x16 packing.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
// The AVX2 loops are compiled into every x86-64 build (a function-level target), so that they can be tested and
// measured on any CPU that has AVX2, FMA and F16C; they are the default only where the build itself targets
// AVX2 and nothing wider (an AVX2-only CPU, or a bigger one under ONEDNN_MAX_CPU_ISA=AVX2).
#define KVSCOPE_AVX2_LOOPS 1
#define KVSCOPE_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

using at::Tensor;

constexpr int64_t kBlock = 32;       // weights per block, for every type here
constexpr int64_t kRowTile = 8;      // rows of x multiplied per widened block
constexpr int64_t kGemvMaxRows = 32; // above this, widen the weight whole and use ATen's GEMM
constexpr int64_t kGrain = 16;       // output features per parallel task
constexpr int64_t kPrefetchRows = 8; // how far ahead the bf16 tile asks for weight rows (from memory, not cache)

// GGML type ids (ggml.h) and their block sizes in bytes
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
// kvscope's own ids for a type's blocks repacked into the x16 layout (below): kX16 + the GGML type
constexpr int64_t kX16 = 1000;

inline bool is_x16(int64_t type) { return type == kX16 + kQ4_0 || type == kX16 + kQ4_1 || type == kX16 + kQ8_0; }

// An x16 line's bytes per block (x16_line describes the layout), and the offset its sums carry, times sx
template <int64_t kType>
constexpr int64_t x16_head_bytes() { return kType == kQ4_1 ? 64 : 32; }  // 16 d (and 16 m), f16
template <int64_t kType>
constexpr int64_t x16_quant_bytes() { return kType == kQ8_0 ? 512 : 256; }  // 16 rows x 32 weights
template <int64_t kType>
constexpr float x16_offset() { return kType == kQ4_1 ? -128.f : kType == kQ4_0 ? -136.f : -2304.f; }  // x sx

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;  // f16 d, 16 bytes of nibbles
    case kQ4_1: return 20;  // f16 d, f16 m, 16 bytes of nibbles
    case kQ8_0: return 34;  // f16 d, 32 int8
    default: TORCH_CHECK(false, "gguf: unsupported GGML type ", type, " (Q4_0, Q4_1 and Q8_0 are)");
  }
  return 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; the same value
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// float32 -> the nearest bf16, kept as a float32 (round to nearest even; the block's values are finite
// unless the file's scales are not, and then any result is as good).
inline float round_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  std::memcpy(&v, &u, 4);
  return v;
}

// Where a tile's sums go: y[t, o] = sum + bias[o], in x's dtype (float32, or bf16 rounded to nearest even).
struct Out {
  void* data;
  bool bf16;
  const float* bias;  // float32, or null
  int64_t features;   // y's row length

  inline void put(int64_t t, int64_t o, float sum) const {
    const float v = bias != nullptr ? sum + bias[o] : sum;
    if (bf16) {
      static_cast<c10::BFloat16*>(data)[t * features + o] = c10::BFloat16(v);
    } else {
      static_cast<float*>(data)[t * features + o] = v;
    }
  }

  Out at_row(int64_t t0) const {
    return {bf16 ? static_cast<void*>(static_cast<c10::BFloat16*>(data) + t0 * features)
                 : static_cast<void*>(static_cast<float*>(data) + t0 * features),
            bf16, bias, features};
  }
};

// One block's 32 weights as gguf-py computes them in float32: Q4_0 d*(q-8), Q4_1 d*q+m (d*q is exact, so
// one rounding however it is fused), Q8_0 d*q. The low nibbles are weights 0-15, the high ones 16-31.
template <int64_t kType, bool kBf16>
inline void widen(const uint8_t* block, float* w) {
  if constexpr (kType == kQ8_0) {
    const float d = half_at(block);
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
#pragma omp simd
    for (int64_t j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(q[j]);
  } else {
    const float d = half_at(block);
    const uint8_t* q = block + (kType == kQ4_1 ? 4 : 2);
    if constexpr (kType == kQ4_1) {
      const float m = half_at(block + 2);
#pragma omp simd
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        w[j] = d * static_cast<float>(q[j] & 0x0F) + m;
        w[j + kBlock / 2] = d * static_cast<float>(q[j] >> 4) + m;
      }
    } else {  // Q4_0: no minimum (adding a zero would turn gguf-py's -0.0 into +0.0)
#pragma omp simd
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        w[j] = d * static_cast<float>((q[j] & 0x0F) - 8);
        w[j + kBlock / 2] = d * static_cast<float>((q[j] >> 4) - 8);
      }
    }
  }
  if constexpr (kBf16) {
#pragma omp simd
    for (int64_t j = 0; j < kBlock; ++j) w[j] = round_bf16(w[j]);
  }
}

// y[t, o] = sum_k x[t, k] W[o, k] for o in [o0, o1), t < kRows (at most kRowTile); x in float32.
template <int64_t kType, bool kBf16, int64_t kRows>
void gemv_tile(const uint8_t* blocks, int64_t row_bytes, int64_t in, const float* x, const Out& y, int64_t o0,
               int64_t o1) {
  const int64_t nb = in / kBlock, bb = row_bytes / nb;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = blocks + o * row_bytes;
    float acc[kRows][kBlock] = {};
    float w[kBlock];
    for (int64_t b = 0; b < nb; ++b) {
      widen<kType, kBf16>(row + b * bb, w);
      for (int64_t t = 0; t < kRows; ++t) {
        const float* xt = x + t * in + b * kBlock;
#pragma omp simd
        for (int64_t j = 0; j < kBlock; ++j) acc[t][j] += w[j] * xt[j];
      }
    }
    for (int64_t t = 0; t < kRows; ++t) {
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += acc[t][j];
      y.put(t, o, s);
    }
  }
}

#if defined(__AVX512F__)
// The same tile with AVX-512: a block's 32 weights widened into two float32 registers (lo: weights 0-15,
// hi: 16-31), exactly as widen() computes them; two accumulator sets (even and odd blocks) so that
// consecutive blocks' multiply-adds do not wait on each other.
template <int64_t kType>
inline void widen_vec(const uint8_t* block, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(half_at(block));
  if constexpr (kType == kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(block + 2);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else {
    const __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (kType == kQ4_1 ? 4 : 2))));
    __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), qh = _mm512_srli_epi32(q, 4);
    if constexpr (kType == kQ4_0) {
      ql = _mm512_sub_epi32(ql, _mm512_set1_epi32(8));
      qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
    }
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(ql));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(qh));
    if constexpr (kType == kQ4_1) {  // d*q is exact: adding m rounds once, as gguf-py's d*q + m
      const __m512 m = _mm512_set1_ps(half_at(block + 2));
      lo = _mm512_add_ps(lo, m);
      hi = _mm512_add_ps(hi, m);
    }
  }
}

template <int64_t kType, int64_t kRows>
void gemv_tile_f32(const uint8_t* blocks, int64_t row_bytes, int64_t in, const float* x, const Out& y, int64_t o0,
                   int64_t o1) {
  const int64_t nb = in / kBlock, bb = row_bytes / nb;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = blocks + o * row_bytes;
    __m512 acc[2][kRows];
    for (int64_t t = 0; t < kRows; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 lo, hi;
      widen_vec<kType>(row + b * bb, lo, hi);
      __m512* a = acc[b & 1];
      for (int64_t t = 0; t < kRows; ++t) {
        const float* xt = x + t * in + b * kBlock;
        a[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xt), a[t]);
        a[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xt + 16), a[t]);
      }
    }
    for (int64_t t = 0; t < kRows; ++t) y.put(t, o, _mm512_reduce_add_ps(_mm512_add_ps(acc[0][t], acc[1][t])));
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 activations: the widened weights rounded to bf16 (round to nearest even, as torch rounds) and
// multiplied into float32 by the CPU's bf16 dot product, 32 weights at a time. A 4-bit block has only 16
// distinct weights: its table (d*k + m for k = 0..15, rounded to bf16) is computed once, and the 32
// nibbles pick from it in one permute.
template <int64_t kType>
inline __m512bh widen_bf16(const uint8_t* block) {
  if constexpr (kType == kQ8_0) {
    __m512 lo, hi;
    widen_vec<kType>(block, lo, hi);
    return _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi: x's order
  } else {
    const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 d = _mm512_set1_ps(half_at(block));
    __m512 table;
    if constexpr (kType == kQ4_1) {
      table = _mm512_fmadd_ps(d, k, _mm512_set1_ps(half_at(block + 2)));  // d*k is exact: one rounding
    } else {
      table = _mm512_mul_ps(d, _mm512_sub_ps(k, _mm512_set1_ps(8.f)));
    }
    const __m512i table_bf16 = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(table)));
    const __m256i q = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (kType == kQ4_1 ? 4 : 2))));
    const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(q, 4);
    const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(index, table_bf16));
  }
}

// kOuts output features at a time (two: independent accumulator chains, x read once for both).
template <int64_t kType, int64_t kRows, int64_t kOuts>
inline void dot_bf16(const uint8_t* row, int64_t row_bytes, int64_t nb, int64_t bb, const uint16_t* x, int64_t in,
                     const Out& y, int64_t o) {
  __m512 acc[kOuts][kRows];
  for (int64_t r = 0; r < kOuts; ++r)
    for (int64_t t = 0; t < kRows; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * row_bytes + b * bb), _MM_HINT_T0);
    __m512bh w[kOuts];
    for (int64_t r = 0; r < kOuts; ++r) w[r] = widen_bf16<kType>(row + r * row_bytes + b * bb);
    for (int64_t t = 0; t < kRows; ++t) {
      const __m512i xt = _mm512_loadu_si512(x + t * in + b * kBlock);
      for (int64_t r = 0; r < kOuts; ++r)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w[r], reinterpret_cast<const __m512bh&>(xt));
    }
  }
  for (int64_t r = 0; r < kOuts; ++r)
    for (int64_t t = 0; t < kRows; ++t) y.put(t, o + r, _mm512_reduce_add_ps(acc[r][t]));
}

template <int64_t kType, int64_t kRows>
void gemv_tile_bf16(const uint8_t* blocks, int64_t row_bytes, int64_t in, const uint16_t* x, const Out& y,
                    int64_t o0, int64_t o1) {
  const int64_t nb = in / kBlock, bb = row_bytes / nb;
  int64_t o = o0;
  for (; o + 2 <= o1; o += 2) dot_bf16<kType, kRows, 2>(blocks + o * row_bytes, row_bytes, nb, bb, x, in, y, o);
  if (o < o1) dot_bf16<kType, kRows, 1>(blocks + o * row_bytes, row_bytes, nb, bb, x, in, y, o);
}
#endif
#endif

#if defined(KVSCOPE_AVX2_LOOPS)
// The tile with AVX2 + FMA + F16C: a block's 32 weights widened into four float32 registers (weights 0-7, 8-15,
// 16-23, 24-31), each exactly widen()'s value (for Q4_1 one fused d*q + m: d*q is exact, so one rounding, as
// gguf-py's). x is float32; bf16 activations (kBf16) have the weights rounded to bf16 first, as widen() does.
KVSCOPE_AVX2 inline __m256 half_avx2(const uint8_t* p) {  // an f16 broadcast to eight float32 lanes
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm256_set1_ps(_cvtsh_ss(bits));
}

template <int64_t kType, bool kBf16>
KVSCOPE_AVX2 inline void widen_avx2(const uint8_t* block, __m256 w[4]) {
  const __m256 d = half_avx2(block);
  if constexpr (kType == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const uint8_t* qs = block + (kType == kQ4_1 ? 4 : 2);
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int i = 0; i < 2; ++i) {  // bytes 8i..8i+7: their low nibbles are weights 8i.., their high ones 16 + 8i..
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i)));
      __m256i ql = _mm256_and_si256(q, low), qh = _mm256_srli_epi32(q, 4);
      if constexpr (kType == kQ4_0) {
        ql = _mm256_sub_epi32(ql, _mm256_set1_epi32(8));
        qh = _mm256_sub_epi32(qh, _mm256_set1_epi32(8));
        w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(ql));
        w[i + 2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(qh));
      } else {
        const __m256 m = half_avx2(block + 2);
        w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(ql), m);
        w[i + 2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(qh), m);
      }
    }
  }
  if constexpr (kBf16) {  // round_bf16 on eight lanes: round to nearest even, then drop the low 16 bits
    for (int i = 0; i < 4; ++i) {
      __m256i u = _mm256_castps_si256(w[i]);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
      w[i] = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
  }
}

KVSCOPE_AVX2 inline float sum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Up to kAvx2RowTile rows of x per widened block. One row has four accumulators (a block's four multiply-adds
// would otherwise wait on each other's latency), more rows two each, which keeps to AVX2's 16 registers.
constexpr int64_t kAvx2RowTile = 4;

template <int64_t kType, bool kBf16, int64_t kRows>
KVSCOPE_AVX2 void gemv_tile_avx2(const uint8_t* blocks, int64_t row_bytes, int64_t in, const float* x, const Out& y,
                                 int64_t o0, int64_t o1) {
  constexpr int kAcc = kRows == 1 ? 4 : 2;
  const int64_t nb = in / kBlock, bb = row_bytes / nb;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = blocks + o * row_bytes;
    __m256 acc[kRows][kAcc];
    for (int64_t t = 0; t < kRows; ++t)
      for (int a = 0; a < kAcc; ++a) acc[t][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      widen_avx2<kType, kBf16>(row + b * bb, w);
      for (int64_t t = 0; t < kRows; ++t) {
        const float* xt = x + t * in + b * kBlock;
        for (int i = 0; i < 4; ++i) {
          acc[t][i % kAcc] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xt + 8 * i), acc[t][i % kAcc]);
        }
      }
    }
    for (int64_t t = 0; t < kRows; ++t) {
      __m256 s = acc[t][0];
      for (int a = 1; a < kAcc; ++a) s = _mm256_add_ps(s, acc[t][a]);
      y.put(t, o, sum_avx2(s));
    }
  }
}

bool avx2_here() {  // this CPU runs the AVX2 loops (every x86-64 build has them)
  static const bool here = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return here;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVSCOPE_X16 1
// The x16 layout (gguf_linear.py's pack_x16): 16 output rows interleaved, so that a vector's 16 float lanes
// are 16 outputs and a block's nibbles become bf16 weights in one unpack each, with no table and no
// horizontal sum. A line (16 rows) holds, per block b: their 16 f16 d, for Q4_1 their 16 f16 m, then their
// quants in chunks of 64 bytes. A 4-bit chunk c (of 4) holds in its byte 16L + i row 4L + (i % 8) / 2's
// weight k = 8c + 2(i >= 8) + i % 2 in the low nibble and k + 4 in the high one: unpacklo/unpackhi_epi8 of
// the low nibbles then give one register per pair of weights (lanes = rows, 2 weights each, as vdpbf16ps
// multiplies them). A Q8_0 chunk c (of 8) holds in the same byte the same row's weight 4c + 2(i >= 8) + i % 2,
// whole.
//
// A nibble q is unpacked beside the byte 0x43: the bf16 0x43qq is exactly 128 + q. So a block's sum
// S' = sum_k (128 + q_k) x_k in float32, and sum_k w_k x_k = d (S' - 128 sx) + m sx (Q4_1: w = d q + m),
// or d (S' - 136 sx) (Q4_0: w = d (q - 8)), with sx the block's sum of x. A Q8_0 weight's q + 128 is split
// into nibbles h, l, each a plane of its own: sum_k q_k x_k = 16 S'_h + S'_l - 2304 sx. The weights are the
// file's exact values (not rounded to bf16 as a dequantized model holds them); float32 absorbs the offsets'
// few bits.
constexpr int64_t kX16Rows = 16;
constexpr int64_t kX16RowTile = 4;  // rows of x per pass over a line (which then stays in L1)
// bytes ahead of a block that it asks for (lines lie one after another): 2 KiB took one pass of SmolLM2's
// Q4_1 layers from 8.5 ms to 5.0 (1 KiB 5.7, 4 KiB 5.5; 2-core Xeon, 2 threads, one row)
constexpr int64_t kX16Prefetch = 2048;

template <int64_t kType, int64_t kRows>
inline void x16_line(const uint8_t* line, int64_t nb, const uint16_t* x, int64_t in, const float* sx,
                     const float* offset_sx, const Out& y, int64_t o) {
  constexpr int64_t kHead = x16_head_bytes<kType>(), kBytes = kHead + x16_quant_bytes<kType>();
  const __m512i low = _mm512_set1_epi8(0x0F), exponent = _mm512_set1_epi8(0x43);
  const auto pair_of = [](const uint16_t* xk) {  // x's weights k, k+1 in every 32-bit lane
    int32_t pair;
    std::memcpy(&pair, xk, 4);
    const __m512i v = _mm512_set1_epi32(pair);
    return reinterpret_cast<const __m512bh&>(v);
  };
  const auto dot = [](__m512 acc, __m512i w, __m512bh x) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(w), x);
  };
  __m512 acc[kRows];
  for (int64_t t = 0; t < kRows; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = line + b * kBytes;
    for (int64_t ahead = 0; ahead < kBytes; ahead += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kX16Prefetch + ahead), _MM_HINT_T0);
    }
    __m512 s[kRows][2];
    for (int64_t t = 0; t < kRows; ++t) {
      s[t][0] = _mm512_set1_ps(offset_sx[t * nb + b]);  // a broadcast load: S' starts at the offset times sx
      s[t][1] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < x16_quant_bytes<kType>() / 64; ++c) {
      __m512i v = _mm512_loadu_si512(p + kHead + 64 * c);
      if constexpr (kType == kQ8_0) v = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i w[4] = {_mm512_unpacklo_epi8(lo, exponent), _mm512_unpackhi_epi8(lo, exponent),
                            _mm512_unpacklo_epi8(hi, exponent), _mm512_unpackhi_epi8(hi, exponent)};
      for (int64_t t = 0; t < kRows; ++t) {
        if constexpr (kType == kQ8_0) {  // pairs 4c, 4c + 2; the low plane into s[0], the high into s[1]
          const uint16_t* xk = x + t * in + b * kBlock + 4 * c;
          const __m512bh a = pair_of(xk), z = pair_of(xk + 2);
          s[t][0] = dot(dot(s[t][0], w[0], a), w[1], z);
          s[t][1] = dot(dot(s[t][1], w[2], a), w[3], z);
        } else {  // pairs 8c, 8c + 2 (low nibbles), 8c + 4, 8c + 6 (high nibbles)
          const uint16_t* xk = x + t * in + b * kBlock + 8 * c;
          s[t][0] = dot(dot(s[t][0], w[0], pair_of(xk)), w[2], pair_of(xk + 4));
          s[t][1] = dot(dot(s[t][1], w[1], pair_of(xk + 2)), w[3], pair_of(xk + 6));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int64_t t = 0; t < kRows; ++t) {
      const __m512 sum = kType == kQ8_0 ? _mm512_fmadd_ps(_mm512_set1_ps(16.f), s[t][1], s[t][0])
                                        : _mm512_add_ps(s[t][0], s[t][1]);
      acc[t] = _mm512_fmadd_ps(d, sum, acc[t]);
    }
    if constexpr (kType == kQ4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      for (int64_t t = 0; t < kRows; ++t) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[t * nb + b]), acc[t]);
    }
  }
  for (int64_t t = 0; t < kRows; ++t) {
    alignas(64) float sums[kX16Rows];
    _mm512_store_ps(sums, acc[t]);
    for (int64_t r = 0; r < kX16Rows; ++r) y.put(t, o + r, sums[r]);
  }
}
#endif

template <int64_t kValue>
using Const = std::integral_constant<int64_t, kValue>;

// run(Const<n>) for 1 <= n <= kMax, with n a compile-time constant.
template <int64_t kMax, typename Run>
void with_count(int64_t n, const Run& run) {
  if constexpr (kMax > 1) {
    if (n < kMax) return with_count<kMax - 1>(n, run);
  }
  run(Const<kMax>{});
}

// tile(t0, Const<R>) for each run of up to kMax rows of x starting at row t0.
template <int64_t kMax = kRowTile, typename Tile>
void over_row_tiles(int64_t rows, const Tile& tile) {
  for (int64_t t0 = 0; t0 < rows; t0 += kMax) {
    with_count<kMax>(std::min(kMax, rows - t0), [&](auto n) { tile(t0, n); });
  }
}

// run(Const<type>) with the block type as a compile-time constant.
template <typename Run>
void with_type(int64_t type, const Run& run) {
  switch (type) {
    case kQ4_0: return run(Const<kQ4_0>{});
    case kQ4_1: return run(Const<kQ4_1>{});
    default: return run(Const<kQ8_0>{});
  }
}

// blocks [out, in / 32 * block bytes] uint8 (x16: [out / 16, in / 32 * 16 block bytes]) -> the in-features
// count, checked.
int64_t check_blocks(const Tensor& blocks, int64_t type) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.device().is_cpu(),
              "gguf: blocks must be a contiguous [out, bytes per row] uint8 CPU tensor");
  const int64_t bb = is_x16(type) ? 16 * block_bytes(type - kX16) : block_bytes(type);
  TORCH_CHECK(blocks.size(1) % bb == 0 && blocks.size(1) > 0, "gguf: a row of ", blocks.size(1),
              " bytes is not whole blocks of ", bb);
  return blocks.size(1) / bb * kBlock;
}

int64_t out_features(const Tensor& blocks, int64_t type) {
  return is_x16(type) ? blocks.size(0) * 16 : blocks.size(0);
}

// An x16 line's 16 rows back as gguf-py computes them in float32 (the layout is described at x16_line; the
// arithmetic is widen()'s).
template <int64_t kType>
void x16_widen_line(const uint8_t* line, int64_t nb, int64_t in, float* w) {
  constexpr int64_t kHead = x16_head_bytes<kType>(), kQuants = x16_quant_bytes<kType>();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = line + b * (kHead + kQuants);
    for (int64_t j = 0; j < kQuants; ++j) {
      const int64_t c = j / 64, i = j % 16, row = 4 * (j % 64 / 16) + (i % 8) / 2;
      const float d = half_at(p + 2 * row);
      const uint8_t byte = p[kHead + j];
      float* out = w + row * in + b * kBlock;
      if constexpr (kType == kQ8_0) {
        out[4 * c + 2 * (i >= 8) + i % 2] = d * static_cast<float>(static_cast<int8_t>(byte));
      } else {
        const int64_t k = 8 * c + 2 * (i >= 8) + i % 2;
        if constexpr (kType == kQ4_1) {
          const float m = half_at(p + 32 + 2 * row);
          out[k] = d * static_cast<float>(byte & 0x0F) + m;
          out[k + 4] = d * static_cast<float>(byte >> 4) + m;
        } else {
          out[k] = d * static_cast<float>((byte & 0x0F) - 8);
          out[k + 4] = d * static_cast<float>((byte >> 4) - 8);
        }
      }
    }
  }
}

// The weight [out, in] in `dtype` (float32 or bf16), every value as gguf-py's dequantizer gives it, rounded.
Tensor gguf_dequantize(const Tensor& blocks, int64_t type, at::ScalarType dtype) {
  const int64_t in = check_blocks(blocks, type), out = out_features(blocks, type), nb = in / kBlock;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gguf_dequantize: float32 or bfloat16 only");
  Tensor w = at::empty({out, in}, at::kFloat);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  if (is_x16(type)) {
    at::parallel_for(0, blocks.size(0), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        with_type(type - kX16, [&](auto type_c) {
          x16_widen_line<decltype(type_c)::value>(src + g * row_bytes, nb, in, dst + g * 16 * in);
        });
      }
    });
    return dtype == at::kFloat ? w : w.to(dtype);
  }
  const int64_t bb = block_bytes(type);
  at::parallel_for(0, out, kGrain, [&](int64_t o0, int64_t o1) {
    with_type(type, [&](auto type_c) {
      constexpr int64_t kType = decltype(type_c)::value;
      for (int64_t o = o0; o < o1; ++o)
        for (int64_t b = 0; b < nb; ++b) widen<kType, false>(src + o * row_bytes + b * bb, dst + o * in + b * kBlock);
    });
  });
  return dtype == at::kFloat ? w : w.to(dtype);
}

#if defined(KVSCOPE_X16)
// y [rows, out] = x [rows, in] (bf16, contiguous) times an x16 weight: each thread takes whole lines of 16
// outputs and runs every row tile of x over a line while it is in L1.
Tensor x16_linear(const Tensor& x, const Tensor& lines, int64_t type, const std::optional<Tensor>& bias, int64_t in,
                  int64_t out) {
  const int64_t rows = x.size(0), nb = in / kBlock, line_bytes = lines.size(1);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  // each block's sum of x in float32, and that sum times the nibbles' offset (x16_line)
  std::vector<float> sx(rows * nb), offset_sx(rows * nb);
  float offset = 0.f;
  with_type(type - kX16, [&](auto type_c) { offset = x16_offset<decltype(type_c)::value>(); });
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int64_t k = 0; k < kBlock; ++k) {
        s += static_cast<float>(c10::BFloat16(xs[t * in + b * kBlock + k], c10::BFloat16::from_bits()));
      }
      sx[t * nb + b] = s;
      offset_sx[t * nb + b] = offset * s;
    }
  Tensor y = at::empty({rows, out}, x.options());
  const Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : Tensor();
  const Out sink{y.data_ptr(), true, bias.has_value() ? bias32.data_ptr<float>() : nullptr, out};
  const uint8_t* w = lines.data_ptr<uint8_t>();
  at::parallel_for(0, lines.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* line = w + g * line_bytes;
      with_type(type - kX16, [&](auto type_c) {
        over_row_tiles<kX16RowTile>(rows, [&](int64_t t0, auto rows_c) {
          x16_line<decltype(type_c)::value, decltype(rows_c)::value>(line, nb, xs + t0 * in, in, sx.data() + t0 * nb,
                                                                     offset_sx.data() + t0 * nb, sink.at_row(t0),
                                                                     g * kX16Rows);
        });
      });
    }
  });
  return y;
}
#endif

bool gguf_x16() {  // whether gguf_linear multiplies x16 lines here (bf16 x); elsewhere it dequantizes them
#if defined(KVSCOPE_X16)
  return true;
#else
  return false;
#endif
}

// The loops that multiply a file's blocks (not x16 lines) for x of `dtype` here, fastest first: the first is
// gguf_linear's. "avx512-bf16": bf16 dot products (AVX-512 BF16); "avx512": AVX-512 float32; "avx2": AVX2 + FMA
// + F16C, the default where the build targets nothing wider; "generic": plain C++ (auto-vectorized).
std::vector<std::string> gguf_paths(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gguf_paths: float32 or bfloat16 only");
  std::vector<std::string> paths;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (dtype == at::kBFloat16) paths.push_back("avx512-bf16");
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) paths.push_back("avx512");
#endif
#if defined(KVSCOPE_AVX2_LOOPS)
  if (avx2_here()) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    paths.push_back("avx2");
#else
    paths.insert(paths.end(), {"generic", "avx2"});  // built for a CPU below AVX2: generic stays the default
    return paths;
#endif
  }
#endif
  paths.push_back("generic");
  return paths;
}

// gguf_linear on the named loops ("" for the default); tests and benchmarks/gguf_linear.py name each.
Tensor gguf_linear_on(const Tensor& x, const Tensor& blocks, int64_t type, const std::optional<Tensor>& bias,
                      c10::string_view path_name) {
  const int64_t in = check_blocks(blocks, type), out = out_features(blocks, type);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "gguf_linear: x's last dimension is ", x.size(-1),
              ", the weight's ", in);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gguf_linear: x must be float32 or bfloat16");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == out), "gguf_linear: bias must be [out]");
  const int64_t rows = x.numel() / in;
  auto out_shape = x.sizes().vec();
  out_shape.back() = out;
  if (rows > kGemvMaxRows) {  // arithmetic-bound: widen once, then ATen's GEMM
    return at::linear(x, gguf_dequantize(blocks, type, x.scalar_type()), bias);
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (is_x16(type)) {
#if defined(KVSCOPE_X16)
    if (bf16) return x16_linear(x.reshape({rows, in}).contiguous(), blocks, type, bias, in, out).view(out_shape);
#endif
    return at::linear(x, gguf_dequantize(blocks, type, x.scalar_type()), bias);  // kvscope packs only for the above
  }
  const std::vector<std::string> paths = gguf_paths(x.scalar_type());
  const std::string path = path_name.empty() ? paths.front() : std::string(path_name);
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "gguf_linear: no '", path,
              "' loops for ", x.scalar_type(), " here");
  const bool bf16_dot = path == "avx512-bf16";  // bf16 x read as it is, multiplied by the CPU's bf16 dot product
  const bool avx2 = path == "avx2", avx512 = path == "avx512";
  const Tensor xs = bf16_dot ? x.reshape({rows, in}).contiguous() : x.reshape({rows, in}).to(at::kFloat).contiguous();
  Tensor y = at::empty({rows, out}, x.options());
  const Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : Tensor();
  const Out sink{y.data_ptr(), bf16, bias.has_value() ? bias32.data_ptr<float>() : nullptr, out};
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  at::parallel_for(0, out, kGrain, [&](int64_t o0, int64_t o1) {
    with_type(type, [&](auto type_c) {
      constexpr int64_t kType = decltype(type_c)::value;
#if defined(KVSCOPE_AVX2_LOOPS)
      if (avx2) {
        return over_row_tiles<kAvx2RowTile>(rows, [&](int64_t t0, auto rows_c) {
          constexpr int64_t kRows = decltype(rows_c)::value;
          const float* xt = xs.data_ptr<float>() + t0 * in;
          if (bf16) return gemv_tile_avx2<kType, true, kRows>(w, row_bytes, in, xt, sink.at_row(t0), o0, o1);
          return gemv_tile_avx2<kType, false, kRows>(w, row_bytes, in, xt, sink.at_row(t0), o0, o1);
        });
      }
#endif
      over_row_tiles(rows, [&](int64_t t0, auto rows_c) {
        constexpr int64_t kRows = decltype(rows_c)::value;
        const Out yt = sink.at_row(t0);
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
        if (bf16_dot) {
          const uint16_t* xt = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>()) + t0 * in;
          return gemv_tile_bf16<kType, kRows>(w, row_bytes, in, xt, yt, o0, o1);
        }
#endif
        const float* xt = xs.data_ptr<float>() + t0 * in;
#if defined(__AVX512F__)
        if (avx512) return gemv_tile_f32<kType, kRows>(w, row_bytes, in, xt, yt, o0, o1);
#endif
        if (bf16) return gemv_tile<kType, true, kRows>(w, row_bytes, in, xt, yt, o0, o1);
        return gemv_tile<kType, false, kRows>(w, row_bytes, in, xt, yt, o0, o1);
      });
    });
  });
  (void)bf16_dot, (void)avx2, (void)avx512;
  return y.view(out_shape);
}

Tensor gguf_linear(const Tensor& x, const Tensor& blocks, int64_t type, const std::optional<Tensor>& bias) {
  return gguf_linear_on(x, blocks, type, bias, "");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int type, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, ScalarType dtype) -> Tensor");
  m.def("gguf_x16() -> bool", &gguf_x16);
  m.def("gguf_paths(ScalarType dtype) -> str[]", &gguf_paths);
  m.def("gguf_linear_on(Tensor x, Tensor blocks, int type, Tensor? bias, str path) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_linear_on", &gguf_linear_on);
  m.impl("gguf_dequantize", &gguf_dequantize);
}

