// A decode step's bf16 linear layers on AMX tiles, reading the weight oneDNN packed (cpu_linear.py) in place.
//
// A decode step multiplies a few rows of x by every weight once, so its GEMMs should run at the memory's
// read bandwidth. oneDNN's packed GEMMs do not at these shapes: on a 2-core Xeon with AMX, Qwen3-0.6B's 28
// layers of linear weights (0.88 GB) took 65-75 ms at 1-16 rows and 100 ms at 24-32 rows (9-13 GB/s),
// where a plain sum over memory reads 22 GB/s. This loop keeps 32 output columns' weights streaming through
// two B tiles, prefetched a few KiB ahead, and every 16 rows of x in an A tile, so each weight byte is read
// from memory once per call, whatever the rows.
//
// The weight is the one oneDNN already holds, read through its data pointer: with AMX oneDNN lays a bf16
// [N, K] weight out as AB16b32a2b, [N/32][K/32][16 k-pairs][32 n][2 k] (oneDNN's own name for that layout),
// which is AMX's B-tile layout, 32 columns wide. cpu_linear.py checks, for every weight, that its packed
// bytes are exactly this layout of the dense weight (amx_blocks_match) before using this kernel; no
// second copy of the weight is made. Accumulation is float32 over K in order, 32 at a time, as the tiles
// do it, then rounded once to bf16 (the bias, if any, added in float32 first).
//
// Registered as kvscope::amx_bf16 (whether the kernel is built and the OS lets this process use the tiles),
// kvscope::amx_linear and kvscope::amx_blocks_match.

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVSCOPE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using at::Tensor;

constexpr int64_t kCols = 32;           // output columns per block of the layout (two B tiles)
constexpr int64_t kDepth = 32;          // K per block: a tile row of 32 bf16 (16 pairs)
constexpr int64_t kBlockElems = kCols * kDepth;  // 1,024 bf16, 2 KiB, contiguous
constexpr int64_t kPrefetchBlocks = 4;  // how far ahead the weight stream is asked for (8 KiB); 2-16 read alike (docs/KERNELS.md)

using kvscope_onednn::onednn_data;
using kvscope_onednn::onednn_nbytes;

// The packed weight's [N, K], checked to be a size this layout holds without padding.
std::pair<int64_t, int64_t> checked_shape(const Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn() && packed.dim() == 2 && packed.scalar_type() == at::kBFloat16,
              "amx: the weight must be a bf16 [N, K] packed by oneDNN (cpu_linear.py)");
  const int64_t n = packed.size(0), k = packed.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kDepth == 0 && onednn_nbytes(packed) == n * k * 2,
              "amx: a [", n, ", ", k, "] weight is not held as whole 32x32 blocks");
  return {n, k};
}

bool amx_bf16() {
#if defined(KVSCOPE_AMX)
  // Linux hands out the tiles' 8 KiB of state per process, on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

// Whether packed's bytes are dense [N, K] laid out as [N/32][K/32][16][32][2], exactly.
bool amx_blocks_match(const Tensor& packed, const Tensor& dense) {
  const auto [n, k] = checked_shape(packed);
  return kvscope_onednn::pair_blocks_match("amx_blocks_match", packed, dense, n, k, kCols, kDepth);
}

#if defined(KVSCOPE_AMX)
// _tile_loadconfig's 64 bytes (palette 1): every tile here is 64 bytes wide, B tiles 16 rows (16 k-pairs),
// A and C tiles as many rows as the chunk of x has (a tile's product costs in proportion to A's rows, so
// 24 rows cost three quarters of 32, where padding to whole tiles of 16 made them cost all of it).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  // rows 0-15 of a chunk of `rows` in C 0-1 and A 4, rows 16-31 in C 2-3 and A 5; B 6-7 always 16.
  static TileConfig for_chunk(int64_t rows) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    const auto first = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
    const auto second = static_cast<uint8_t>(std::clamp<int64_t>(rows - 16, 1, 16));
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = first;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = second;
    return cfg;
  }
};

// Tiles: C 0-3 (rows 0-15 and 16-31 of a 32-row chunk, columns 0-15 and 16-31), A 4-5, B 6-7.
// out[m, nb*32 + c] for m in [0, rows) of the chunk at x (row stride k), rows as the tile config says.
template <bool kTwoRowTiles>
inline void chunk_block(const uint16_t* x, int64_t k, const uint16_t* w, int64_t kbs, float (*c)[16][16]) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint16_t* blk = w + kb * kBlockElems;
    const char* ahead = reinterpret_cast<const char*>(blk + kPrefetchBlocks * kBlockElems);
    for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    _tile_loadd(6, blk, kCols * 4);       // columns 0-15: the first 64 bytes of each 128-byte row
    _tile_loadd(7, blk + 32, kCols * 4);  // columns 16-31
    _tile_loadd(4, x + kb * kDepth, k * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, x + 16 * k + kb * kDepth, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if constexpr (kTwoRowTiles) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}
#endif

Tensor amx_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  const auto [n, k] = checked_shape(packed);
  TORCH_CHECK(amx_bf16(), "amx_linear: AMX tiles are not available here (kvscope::amx_bf16() is false)");
  const auto call = kvscope_onednn::linear_call("amx_linear", x, n, k, bias);
  const int64_t m = call.m;
  if (m == 0) return call.out;
#if defined(KVSCOPE_AMX)
  const uint16_t* w = onednn_data(packed);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(call.x.data_ptr());
  c10::BFloat16* o = call.out.data_ptr<c10::BFloat16>();
  const float* bp = call.bias.has_value() ? call.bias->data_ptr<float>() : nullptr;
  const int64_t kbs = k / kDepth;
  at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
    int64_t configured = 0;  // the chunk size the tiles are configured for
    alignas(64) float c[4][16][16];
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint16_t* wb = w + nb * kbs * kBlockElems;  // this block's 32 columns, all of K: L2-resident after
      for (int64_t r0 = 0; r0 < m; r0 += 32) {           // the first chunk, so each byte leaves memory once
        const int64_t rows = std::min<int64_t>(m - r0, 32);
        if (rows != configured) {
          const TileConfig cfg = TileConfig::for_chunk(rows);
          _tile_loadconfig(&cfg);
          configured = rows;
        }
        const bool two = rows > 16;
        if (two)
          chunk_block<true>(xs + r0 * k, k, wb, kbs, c);
        else
          chunk_block<false>(xs + r0 * k, k, wb, kbs, c);
        for (int64_t r = r0; r < std::min(m, r0 + 32); ++r) {
          const int64_t tile = (r - r0) < 16 ? 0 : 2, row = (r - r0) % 16;
          for (int64_t half = 0; half < 2; ++half) {
            c10::BFloat16* dst = o + r * n + nb * kCols + half * 16;
            const float* acc = c[tile + half][row];
            for (int64_t j = 0; j < 16; ++j)
              dst[j] = c10::BFloat16(bp ? acc[j] + bp[nb * kCols + half * 16 + j] : acc[j]);
          }
        }
      }
    }
    _tile_release();
  });
#endif
  return call.out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("amx_bf16() -> bool", &amx_bf16);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_blocks_match(Tensor packed, Tensor dense) -> bool");
}

// The packed weight is a oneDNN tensor (dispatch key MkldnnCPU), which outranks CPU in dispatch.
TORCH_LIBRARY_IMPL(kvscope, MkldnnCPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_blocks_match", &amx_blocks_match);
}
