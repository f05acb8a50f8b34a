// Decode attention on the CPU that reads K and V straight from the paged cache.
//
// The torch reference gathers each sequence's blocks into a copy and then runs SDPA over the
// copy, so every K/V byte crosses memory twice (plus the write of the copy). Here each work
// item, one sequence and a range of its KV heads (all of them where there are sequences enough
// to share out), walks the block table and streams each block's rows once: every query head of
// those KV heads is scored against a row while it is in L1, and the softmax is online (running
// max and sum per query head, in fp32).
//
// With a bf16 query and cache on a CPU with AVX-512 BF16 (attend_bf16), the products are the
// instruction vdpbf16ps's on the bf16 values as they lie in the cache, with no widening to fp32
// first: a third of the instructions of the fp32 loop, which on a 2-core Xeon was arithmetic-bound
// (7 GB/s of K/V against 20 of memory copy).
//
// Registered as the op kvscope::paged_decode_attention, so torch's profiler sees it by name.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVSCOPE_ATTENTION_BF16 1
#include <immintrin.h>
#endif

namespace {

// Reductions over the head dimension: `omp simd` lets the compiler vectorise them without
// -ffast-math (which would also assume no NaN, and the tests feed NaN to unread blocks).
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc += sum over t of p[t] * rows[t], 64 floats of acc at a time held in registers across the
// block's rows (written as a fixed-length inner loop: the compiler keeps `a` in vector registers).
constexpr int64_t kAccLanes = 64;

inline void accumulate(float* acc, const float* p, const float* rows, int64_t stride, int64_t n, int64_t d) {
  int64_t i0 = 0;
  for (; i0 + kAccLanes <= d; i0 += kAccLanes) {
    float a[kAccLanes];
    for (int64_t l = 0; l < kAccLanes; ++l) a[l] = acc[i0 + l];
    for (int64_t t = 0; t < n; ++t) {
      const float pt = p[t];
      const float* r = rows + t * stride + i0;
#pragma omp simd
      for (int64_t l = 0; l < kAccLanes; ++l) a[l] += pt * r[l];
    }
    for (int64_t l = 0; l < kAccLanes; ++l) acc[i0 + l] = a[l];
  }
  for (int64_t t = 0; t < n; ++t) {  // head dims that are not a multiple of 64
#pragma omp simd
    for (int64_t i = i0; i < d; ++i) acc[i] += p[t] * rows[t * stride + i];
  }
}

inline void scale_in_place(float* x, float w, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= w;
}

// A block's rows of one KV head as fp32 rows `stride` floats apart: float rows are used where they
// lie in the cache, bf16 rows widened into the tile (a bf16 is the top half of a float's bits, so
// the widening is a shift the compiler vectorises).
struct Rows {
  const float* data;
  int64_t stride;
};

inline Rows rows_as_float(const float* src, int64_t n, int64_t row_stride, float* /*tile*/, int64_t /*d*/) {
  return {src, row_stride};
}

inline Rows rows_as_float(const c10::BFloat16* src, int64_t n, int64_t row_stride, float* tile, int64_t d) {
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src + t * row_stride);
    float* dst = tile + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
      float f;
      std::memcpy(&f, &widened, sizeof f);
      dst[i] = f;
    }
  }
  return {tile, d};
}

// exp(x) for x <= 0 (scores minus their running max), vectorisable: 2^(x log2 e) split into an
// integer power (built in the exponent bits) and a degree-6 polynomial for 2^f, f in [-0.5, 0.5];
// relative error about 2e-7, below fp32's rounding of the sums it feeds.
inline void exp_in_place(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float clamped = x[i] < -87.0f ? -87.0f : x[i];  // below -87 the result is 0 to fp32 anyway
    float t = clamped * 1.44269504088896341f;
    float k = std::nearbyint(t);
    float f = t - k;
    float p = 1.53533402e-4f;
    p = p * f + 1.33990727e-3f;
    p = p * f + 9.61797766e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147182e-1f;
    p = p * f + 1.0f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = p * scale;
  }
}

// Round to bf16 (nearest, ties to even) and back: torch's CPU flash attention in bf16 rounds the
// softmax weights to bf16 for its P @ V product (their sum stays fp32), and the engine's bf16 tokens
// are checked against transformers running that kernel; weights kept in fp32 drift further from it.
inline void round_to_bf16(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof bits);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;  // weights are finite, in [0, 1]
    std::memcpy(&x[i], &bits, sizeof bits);
  }
}

template <typename q_t>
constexpr bool kRoundWeights = std::is_same<q_t, c10::BFloat16>::value;  // as SDPA in the query's dtype

struct Shapes {
  int64_t block_size, kv_heads, head_dim, group;  // group: query heads per KV head
  int64_t q_row_stride, q_head_stride, o_row_stride, o_head_stride;
  int64_t table_width;
  int64_t window;  // <= 0: none
  float scale;
  int64_t heads_per_item;  // KV heads one work item takes (a divisor of kv_heads)
};

// Per-thread scratch, reused across the work items a thread runs.
struct Scratch {
  std::vector<float> q, acc, scores, max, sum, tile;
  explicit Scratch(const Shapes& s) {
    const int64_t qh = s.heads_per_item * s.group;  // query heads of one item
    q.resize(qh * s.head_dim);
    acc.resize(qh * s.head_dim);
    scores.resize(qh * s.block_size);
    max.resize(qh);
    sum.resize(qh);
    tile.resize(s.block_size * s.head_dim);  // one KV head's rows of one block, as fp32
  }
};

// Ask for a block's rows (this item's heads) ahead of use: blocks lie anywhere in the pool, so the
// hardware prefetcher cannot guess the next one, and a KV head's part of a token's row is short.
// Into L2 (prefetcht1), not L1: a whole block's K and V for all heads (64 KiB at Qwen3-0.6B's shape)
// passes between a row's prefetch and its use, more than L1 holds; on a 2-core Zen 5 the decode read
// 15-21 GB/s this way against 11.5-14 into L1, alternating builds three times (benchmarks/cpu_attention_decode.py).
template <typename kv_t>
inline void prefetch_block(const kv_t* first_row, int64_t rows, int64_t row_stride, int64_t row_bytes) {
  for (int64_t t = 0; t < rows; ++t) {
    const char* p = reinterpret_cast<const char*>(first_row + t * row_stride);
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
  }
}

// Online softmax over one block's scores sc[0, n) of query head h, once per block: sc becomes the
// weights (rounded to bf16 where `round`), and what came before is rescaled only when the max moved.
inline void softmax_block(Scratch& w, int64_t h, float* sc, int64_t n, int64_t d, bool round) {
  const float block_max = *std::max_element(sc, sc + n);
  const float new_max = std::max(w.max[h], block_max);
  for (int64_t t = 0; t < n; ++t) sc[t] -= new_max;
  exp_in_place(sc, n);
  float block_sum = 0.f;
  for (int64_t t = 0; t < n; ++t) block_sum += sc[t];
  if (round) round_to_bf16(sc, n);
  if (new_max > w.max[h]) {
    const float correction = std::exp(w.max[h] - new_max);  // 0 on the first block (max was -inf)
    w.sum[h] *= correction;
    scale_in_place(&w.acc[h * d], correction, d);  // (attend_bf16's acc is permuted: a scale does not mind)
    w.max[h] = new_max;
  }
  w.sum[h] += block_sum;
}

// One decode query's heads kv_head0 .. kv_head0 + heads_per_item - 1 (and their query heads)
// over one sequence's paged context.
template <typename q_t, typename kv_t>
void attend(const Shapes& s, Scratch& w, const q_t* query, q_t* out, const kv_t* k_cache, const kv_t* v_cache,
            const int32_t* table, int64_t seq_len, int64_t kv_head0) {
  const int64_t d = s.head_dim, g = s.group, bs = s.block_size, nkv = s.heads_per_item, nq = nkv * g;
  for (int64_t h = 0; h < nq; ++h) {
    const q_t* q = query + (kv_head0 * g + h) * s.q_head_stride;
    for (int64_t i = 0; i < d; ++i) w.q[h * d + i] = static_cast<float>(q[i]) * s.scale;
  }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.max.begin(), w.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.end(), 0.f);

  // The query sits at seq_len - 1; with a window it sees only the last `window` keys, and
  // nothing before them is read (blocks there may be freed: garbage ids, garbage contents).
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
  const int64_t row_stride = s.kv_heads * d;  // one token's K (or V) for all KV heads
  const int64_t span = nkv * d;  // this item's contiguous part of a token's row
  const int64_t first_block = first / bs, end_block = (seq_len + bs - 1) / bs;
  auto block_start = [&](int64_t b) { return static_cast<int64_t>(table[b]) * bs * row_stride + kv_head0 * d; };
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t t0 = std::max<int64_t>(first - b * bs, 0);
    const int64_t t1 = std::min<int64_t>(seq_len - b * bs, bs);
    const int64_t n = t1 - t0;
    const int64_t base = block_start(b) + t0 * row_stride;
    if (b + 1 < end_block) {
      const int64_t rows = std::min<int64_t>(seq_len - (b + 1) * bs, bs);
      prefetch_block(k_cache + block_start(b + 1), rows, row_stride, span * sizeof(kv_t));
      prefetch_block(v_cache + block_start(b + 1), rows, row_stride, span * sizeof(kv_t));
    }

    // One KV head at a time: its rows of the block widened into a tile (8 KB at D=128, in L1), then
    // every query head of the group scored, its softmax moved on, and its output accumulated.
    for (int64_t kh = 0; kh < nkv; ++kh) {
      const int64_t head_off = base + kh * d;
      const Rows k = rows_as_float(k_cache + head_off, n, row_stride, w.tile.data(), d);
      for (int64_t h = kh * g; h < (kh + 1) * g; ++h) {
        float* sc = &w.scores[h * bs];
        for (int64_t t = 0; t < n; ++t) sc[t] = dot(&w.q[h * d], k.data + t * k.stride, d);
        softmax_block(w, h, sc, n, d, kRoundWeights<q_t>);
      }
      const Rows v = rows_as_float(v_cache + head_off, n, row_stride, w.tile.data(), d);
      for (int64_t h = kh * g; h < (kh + 1) * g; ++h) {
        accumulate(&w.acc[h * d], &w.scores[h * bs], v.data, v.stride, n, d);
      }
    }
  }
  for (int64_t h = 0; h < nq; ++h) {
    q_t* o = out + (kv_head0 * g + h) * s.o_head_stride;
    const float inv = 1.f / w.sum[h];
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<q_t>(w.acc[h * d + i] * inv);
  }
}

#if defined(KVSCOPE_ATTENTION_BF16)
constexpr int64_t kMaxChunks = 8;  // head_dim up to 256, in chunks of 32 bf16 (one zmm)

inline bool bf16_path(int64_t head_dim) { return head_dim % 32 == 0 && head_dim / 32 <= kMaxChunks; }

inline uint32_t bf16_bits(float x) {  // x already rounded to bf16 (round_to_bf16): its top half, exactly
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits >> 16;
}

// Lane t of the result: the sum of a[t]'s 16 lanes (a transpose-and-add tree, 45 instructions for all 16).
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: [a2i 0+2, a2i+1 0+2, a2i 1+3, a2i+1 1+3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128 bits: tokens 4j .. 4j+3, each that 128 bits' partial sum
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

// attend() for a bf16 query over a bf16 cache, head_dim a multiple of 32: the same blocks, softmax and
// rounding, with the products made by vdpbf16ps on the bf16 values themselves. Scores: q . k summed in
// fp32 (16 lanes, then across them: sum16), times the scale. Outputs: pairs of tokens (t, t+1) interleaved
// word by word (vpunpck{l,h}wd of their V rows) against the pair of their bf16 weights, so each lane
// adds p_t v_t + p_t+1 v_t+1; the unpacks leave a chunk's 32 dims in lanes 0-3, 8-11, ... (low) and
// 4-7, 12-15, ... (high) of each 128 bits, so acc is kept in that order and put back at the end.
void attend_bf16(const Shapes& s, Scratch& w, const c10::BFloat16* query, c10::BFloat16* out,
                 const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* table, int64_t seq_len,
                 int64_t kv_head0) {
  const int64_t d = s.head_dim, g = s.group, bs = s.block_size, nkv = s.heads_per_item, nq = nkv * g;
  const int64_t chunks = d / 32;
  uint16_t* qb = reinterpret_cast<uint16_t*>(w.q.data());  // the query heads' bf16 bits, in w.q's room
  for (int64_t h = 0; h < nq; ++h)
    std::memcpy(qb + h * d, query + (kv_head0 * g + h) * s.q_head_stride, d * sizeof(uint16_t));
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.max.begin(), w.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.end(), 0.f);

  const int64_t first = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
  const int64_t row_stride = s.kv_heads * d;
  const int64_t first_block = first / bs, end_block = (seq_len + bs - 1) / bs;
  auto block_start = [&](int64_t b) { return static_cast<int64_t>(table[b]) * bs * row_stride + kv_head0 * d; };
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache);
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache);
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t t0 = std::max<int64_t>(first - b * bs, 0);
    const int64_t t1 = std::min<int64_t>(seq_len - b * bs, bs);
    const int64_t n = t1 - t0;
    const int64_t base = block_start(b) + t0 * row_stride;
    // The next block's rows of this KV head, asked for while this head's work runs: spread over the block,
    // not all of the next block at once (which measured 5-14% slower in one process, A B A B).
    const int64_t next_rows = b + 1 < end_block ? std::min<int64_t>(seq_len - (b + 1) * bs, bs) : 0;
    for (int64_t kh = 0; kh < nkv; ++kh) {
      if (next_rows) {
        prefetch_block(k_cache + block_start(b + 1) + kh * d, next_rows, row_stride, d * sizeof(uint16_t));
        prefetch_block(v_cache + block_start(b + 1) + kh * d, next_rows, row_stride, d * sizeof(uint16_t));
      }
      const uint16_t* krows = kc + base + kh * d;
      const uint16_t* vrows = vc + base + kh * d;
      for (int64_t h = kh * g; h < (kh + 1) * g; ++h)
        for (int64_t t = 0; t < n; t += 16) {
          const int64_t m = std::min<int64_t>(16, n - t);
          __m512 a[16];
          for (int64_t i = 0; i < 16; ++i) {
            a[i] = _mm512_setzero_ps();
            if (i >= m) continue;
            for (int64_t c = 0; c < chunks; ++c)
              a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(qb + h * d + 32 * c),
                                      (__m512bh)_mm512_loadu_si512(krows + (t + i) * row_stride + 32 * c));
          }
          alignas(64) float scores[16];
          _mm512_store_ps(scores, _mm512_mul_ps(sum16(a), _mm512_set1_ps(s.scale)));
          std::memcpy(&w.scores[h * bs + t], scores, m * sizeof(float));
        }
      for (int64_t h = kh * g; h < (kh + 1) * g; ++h) softmax_block(w, h, &w.scores[h * bs], n, d, true);
      for (int64_t h = kh * g; h < (kh + 1) * g; ++h) {  // acc in registers across the block's rows
        float* acc = &w.acc[h * d];
        __m512 lo_acc[kMaxChunks], hi_acc[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) {
          lo_acc[c] = _mm512_loadu_ps(acc + 32 * c);
          hi_acc[c] = _mm512_loadu_ps(acc + 32 * c + 16);
        }
        for (int64_t t = 0; t < n; t += 2) {
          const bool pair = t + 1 < n;  // an odd last token pairs with a zero row of weight 0
          const float* p = &w.scores[h * bs + t];
          const uint32_t weights = bf16_bits(p[0]) | (pair ? bf16_bits(p[1]) << 16 : 0u);
          const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights));
          for (int64_t c = 0; c < chunks; ++c) {
            const __m512i a = _mm512_loadu_si512(vrows + t * row_stride + 32 * c);
            const __m512i z = pair ? _mm512_loadu_si512(vrows + (t + 1) * row_stride + 32 * c) : _mm512_setzero_si512();
            lo_acc[c] = _mm512_dpbf16_ps(lo_acc[c], (__m512bh)_mm512_unpacklo_epi16(a, z), pw);
            hi_acc[c] = _mm512_dpbf16_ps(hi_acc[c], (__m512bh)_mm512_unpackhi_epi16(a, z), pw);
          }
        }
        for (int64_t c = 0; c < chunks; ++c) {
          _mm512_storeu_ps(acc + 32 * c, lo_acc[c]);
          _mm512_storeu_ps(acc + 32 * c + 16, hi_acc[c]);
        }
      }
    }
  }
  for (int64_t h = 0; h < nq; ++h) {
    c10::BFloat16* o = out + (kv_head0 * g + h) * s.o_head_stride;
    const float inv = 1.f / w.sum[h];
    const float* acc = &w.acc[h * d];
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t lane = 0; lane < 4; ++lane)
        for (int64_t k = 0; k < 4; ++k) {
          o[32 * c + 8 * lane + k] = static_cast<c10::BFloat16>(acc[32 * c + 4 * lane + k] * inv);
          o[32 * c + 8 * lane + 4 + k] = static_cast<c10::BFloat16>(acc[32 * c + 16 + 4 * lane + k] * inv);
        }
  }
}
#endif

// How many KV heads one work item takes: all of them (a token's whole row, contiguous, read in
// one stream) unless there are too few sequences to keep every thread busy.
int64_t heads_per_item(int64_t kv_heads, int64_t num_seqs) {
  const int64_t wanted_items = 4 * static_cast<int64_t>(at::get_num_threads());
  for (int64_t splits = 1; splits <= kv_heads; ++splits) {
    if (kv_heads % splits == 0 && num_seqs * splits >= wanted_items) return kv_heads / splits;
  }
  return 1;
}

template <typename q_t, typename kv_t>
void decode(const Shapes& s, const at::Tensor& query, at::Tensor& out, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
            const at::Tensor& seq_ids, const at::Tensor& rows) {
  const q_t* q = query.data_ptr<q_t>();
  q_t* o = out.data_ptr<q_t>();
  const kv_t* k = k_cache.data_ptr<kv_t>();
  const kv_t* v = v_cache.data_ptr<kv_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* ids = seq_ids.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t num = seq_ids.numel();
  const int64_t splits = s.kv_heads / s.heads_per_item;
  // Items are head-split-major: where heads are split, every thread gets a share of every
  // sequence, so sequences of different lengths do not unbalance the threads.
  at::parallel_for(0, num * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch w(s);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t split = item / num, i = item % num, seq = ids[i];
#if defined(KVSCOPE_ATTENTION_BF16)
      if constexpr (std::is_same<q_t, c10::BFloat16>::value && std::is_same<kv_t, c10::BFloat16>::value) {
        if (bf16_path(s.head_dim)) {
          attend_bf16(s, w, q + row[i] * s.q_row_stride, o + row[i] * s.o_row_stride, k, v,
                      tables + seq * s.table_width, lens[seq], split * s.heads_per_item);
          continue;
        }
      }
#endif
      attend<q_t, kv_t>(s, w, q + row[i] * s.q_row_stride, o + row[i] * s.o_row_stride, k, v,
                        tables + seq * s.table_width, lens[seq], split * s.heads_per_item);
    }
  });
}

// out[rows[i]] = attention of query[rows[i]] (one decode query of sequence seq_ids[i]) over
// that sequence's paged context. Rows not listed are left as they are.
void paged_decode_attention(const at::Tensor& query, at::Tensor out, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& seq_ids, const at::Tensor& rows,
                            double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [blocks, bs, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be the innermost dimension");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out must have the query's dtype");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32");
  TORCH_CHECK(seq_ids.scalar_type() == at::kLong && rows.scalar_type() == at::kLong, "seq_ids, rows: int64");
  TORCH_CHECK(seq_ids.is_contiguous() && rows.is_contiguous() && seq_ids.numel() == rows.numel(), "ids/rows");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), head_dim = query.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0, "head counts or head_dim do not match");

  Shapes s{k_cache.size(1), kv_heads, head_dim, heads / kv_heads,
           query.stride(0), query.stride(1), out.stride(0), out.stride(1),
           block_tables.size(1), window, static_cast<float>(scale), heads_per_item(kv_heads, seq_ids.numel())};
  const auto qt = query.scalar_type(), kt = k_cache.scalar_type();
  if (qt == at::kFloat && kt == at::kFloat) {
    decode<float, float>(s, query, out, k_cache, v_cache, block_tables, seq_lens, seq_ids, rows);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    decode<c10::BFloat16, c10::BFloat16>(s, query, out, k_cache, v_cache, block_tables, seq_lens, seq_ids, rows);
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    decode<float, c10::BFloat16>(s, query, out, k_cache, v_cache, block_tables, seq_lens, seq_ids, rows);
  } else if (qt == at::kBFloat16 && kt == at::kFloat) {
    decode<c10::BFloat16, float>(s, query, out, k_cache, v_cache, block_tables, seq_lens, seq_ids, rows);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 and bfloat16 only, got ", qt, " and ", kt);
  }
}

}  // namespace

TORCH_LIBRARY(kvscope, m) {
  m.def("paged_decode_attention(Tensor query, Tensor(a!) out, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor seq_ids, Tensor rows, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
