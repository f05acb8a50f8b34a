// A decode step's decoder layers in one call: decoder.py's per-layer forward, op for op, from C++.
//
// At SmolLM2's size (30 layers of width 576) a one-token step is about 1,900 torch calls, and from
// Python each costs microseconds of argument parsing and dispatch before any arithmetic: that host
// work was a third of a single-stream step. Here the same ATen operations run in the same order on
// the same dtypes (so the bits are decoder.py's, which are transformers'), called from C++: the
// Python layer is crossed once per step instead of once per operation. The packed GEMMs are oneDNN's
// (mkldnn::_linear_pointwise, as cpu_linear.py calls them), or kvscope::gguf_linear on a GGUF's blocks
// (cpu_gguf.cpp, under --quantization gguf), and attention is
// kvscope::paged_decode_attention (cpu_attention.cpp), both through the dispatcher so torch's
// profiler still names them.
//
// In bf16 with a bf16 cache (the CPU default), three of those ops run as this file's own one-pass loops
// instead (exact_loops): rotary in place, the k/v rows memcpy'd into their slots, and the residual adds.
// Each rounds where ATen rounds (every product, every sum, to bf16), so the bits do not move; they save
// the temporaries and passes of roll, cat, index_copy_ and add. A bf16 RMSNorm is two such loops around
// ATen's own mean (rms_norm_bf16, also kvscope::rms_norm for decoder.py's prefill loop): the sum of squares
// is ATen's, in ATen's order, which a hand loop would not reproduce. silu stays ATen's (its exp).
//
// Decode rows only (one query per sequence): a step with a prefill chunk runs decoder.py's Python
// loop, whose attention also covers prefills.
//
// Registered as kvscope::decode_layers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using at::Tensor;

// The weights of one layer, in the order decoder.py's NativeLayers flattens them.
constexpr int64_t kWeightsPerLayer = 6;   // input norm, qkv, o, post norm, gate_up, down
constexpr int64_t kLinearsPerLayer = 4;   // qkv, o, gate_up, down: each one's type
constexpr int64_t kOptionalPerLayer = 6;  // qkv, o, gate_up, down biases; q norm, k norm (Qwen3)
constexpr int64_t kEpsPerLayer = 4;       // input norm, post norm, q norm, k norm

// y = x W^T + b on a weight packed by cpu_linear.py.
Tensor packed_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  static const c10::IValue none_attr(std::string("none"));
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(none_attr);
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

// y = x W^T + b on a GGUF's blocks (cpu_gguf.cpp; gguf_blocks.py under --quantization gguf).
Tensor gguf_linear(const Tensor& x, const Tensor& blocks, int64_t type, const std::optional<Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvscope::gguf_linear", "")
                             .typed<Tensor(const Tensor&, const Tensor&, int64_t, const std::optional<Tensor>&)>();
  return op.call(x, blocks, type, bias);
}

// y = x W^T + b on AMX tiles, reading the weight oneDNN packed (cpu_amx.cpp).
Tensor amx_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvscope::amx_linear", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>();
  return op.call(x, packed, bias);
}

// y = x W^T + b with AVX-512 BF16, reading the weight oneDNN packed, K added in oneDNN's blocks (cpu_dpbf16.cpp).
Tensor dpbf16_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t block_k) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvscope::dpbf16_linear", "")
          .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t)>();
  return op.call(x, packed, bias, block_k);
}

// A linear's type: 0 oneDNN-packed; kPackedAmx oneDNN-packed in the layout amx_linear reads (cpu_linear.py's
// use_amx checked it), run there up to kAmxMaxRows rows (cpu_linear.AMX_MAX_ROWS) and on oneDNN above;
// kPackedDpbf16 + (one row's K block << kDpbf16Shift) + more rows' K block: oneDNN-packed in the layout
// dpbf16_linear reads, with oneDNN's K blocks (use_dpbf16 found them), run there up to kDpbf16MaxRows rows
// (cpu_linear.DPBF16_MAX_ROWS) and on oneDNN above; otherwise the GGML type of the weight's blocks, or their
// x16 id (cpu_gguf.cpp).
constexpr int64_t kPackedAmx = 2000;
constexpr int64_t kAmxMaxRows = 32;
constexpr int64_t kPackedDpbf16 = int64_t{1} << 40;  // above every GGML type and x16 id
constexpr int64_t kDpbf16Shift = 20;
constexpr int64_t kDpbf16MaxRows = 12;

inline bool on_dpbf16(int64_t type) { return type > kPackedDpbf16; }
inline bool on_gguf_blocks(int64_t type) { return type != 0 && type != kPackedAmx && !on_dpbf16(type); }

Tensor linear(const Tensor& x, const Tensor& weight, int64_t type, const std::optional<Tensor>& bias) {
  if (type == kPackedAmx && x.size(0) <= kAmxMaxRows) return amx_linear(x, weight, bias);
  if (on_dpbf16(type) && x.size(0) <= kDpbf16MaxRows) {
    const int64_t blocks = type - kPackedDpbf16, mask = (int64_t{1} << kDpbf16Shift) - 1;
    return dpbf16_linear(x, weight, bias, x.size(0) == 1 ? blocks >> kDpbf16Shift : blocks & mask);
  }
  return on_gguf_blocks(type) ? gguf_linear(x, weight, type, bias) : packed_linear(x, weight, bias);
}

// decoder.py's Norm: transformers' llama RMSNorm, in float32, then weight times the input dtype's rounding.
Tensor rms_norm_bf16(const Tensor& x, const Tensor& weight, double eps);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 1 &&
      weight.is_contiguous() && x.dim() >= 1 && weight.numel() == x.size(-1) && x.numel() > 0)
    return rms_norm_bf16(x, weight, eps);
  Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

// decoder.py's _rope: x * cos + rotate_half(x) * sin, with rotate_half as a roll and sin's first half negated.
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  return x * cos + x.roll({x.size(-1) / 2}, {-1}) * signed_sin;
}

void paged_attention(const Tensor& q, Tensor& out, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& block_tables, const Tensor& seq_lens, const Tensor& seq_ids, const Tensor& rows,
                     double scale, int64_t window) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvscope::paged_decode_attention", "")
          .typed<void(const Tensor&, Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, const Tensor&, double, int64_t)>();
  op.call(q, out, k_cache, v_cache, block_tables, seq_lens, seq_ids, rows, scale, window);
}

// ---- one-pass elementwise work, for steps on a GGUF's blocks in bfloat16 (`fused`) -------------------
//
// On the blocks a decode step's GEMMs are short, and the ~25 small ATen calls per layer around them
// (norms, rotary, cache writes, the activation, residual adds), at a few microseconds each, were a
// fifth of a one-stream step. These loops do that work in one pass each, rounding to bfloat16 where
// the ATen ops round, in the same order: only a norm's sum of squares is added in another order (and
// silu's exp is libm's), so a result can differ from the ATen ops' in its last bit, rarely; greedy
// tokens are checked against the unfused loop and the dense model (tests/test_engine_gguf.py).

using Bf16 = c10::BFloat16;

// The same conversions on raw bits, written so that `omp simd` loops vectorise them (c10::BFloat16's
// own are calls the compiler keeps scalar): c10's round to nearest even, a NaN to 0x7fc0.
inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const auto rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0) : rounded;
}
inline float round_bf16(float f) { return widen(narrow(f)); }

// decoder.py's Norm on bf16 x and weight, in two passes of this file's own and ATen's mean: the squares
// (as pow(2) makes them: x * x in fp32), then ATen's mean of them (so the sum is added in ATen's order), then
// w * bf16(x * (1 / sqrt(mean + eps))), each step rounded where the ATen ops round (fp32, then bf16 at `to` and
// at the weight's product). The same bits as the seven ATen calls, with two temporaries fewer.
Tensor rms_norm_bf16(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor xc = x.contiguous();
  const int64_t width = xc.size(-1), rows = xc.numel() / width;
  const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wb = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  Tensor squares = at::empty({rows, width}, xc.options().dtype(at::kFloat));
  float* sq = squares.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / width);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float v = widen(xb[r * width + i]);
        sq[r * width + i] = v * v;
      }
    }
  });
  const Tensor mean = at::mean(squares, {-1});
  const float* mp = mean.data_ptr<float>();
  const float e = static_cast<float>(eps);
  Tensor out = at::empty_like(xc);
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float inv = 1.f / std::sqrt(mp[r] + e);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)
        ob[r * width + i] = narrow(widen(wb[i]) * round_bf16(widen(xb[r * width + i]) * inv));
    }
  });
  return out;
}

// out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)): decoder.py's Norm.
void fused_rms_norm(const Bf16* x, const Bf16* w, Bf16* out, int64_t rows, int64_t width, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const Bf16* xr = x + r * width;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) {
      const float v = static_cast<float>(xr[i]);
      sum += v * v;
    }
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(width) + static_cast<float>(eps));
    Bf16* o = out + r * width;
    for (int64_t i = 0; i < width; ++i)
      o[i] = Bf16(static_cast<float>(w[i]) * round_bf16(static_cast<float>(xr[i]) * scale));
  }
}

// Rotary on the first `heads` heads of each row of qkv [rows, stride] (q's heads, then k's), in place:
// x * cos + roll(x, D/2) * signed_sin, each product and the sum rounded (decoder.py's _rope). `x`: d floats.
// The roll is two loops (the halves swap), not an index modulo d: a division per value made this
// loop 3-4x slower than the vectorised halves, about 10 ms of a 24-row Qwen3-0.6B-shape decode step.
void fused_rope(Bf16* qkv, int64_t rows, int64_t stride, int64_t heads, int64_t d, const Bf16* cos,
                const Bf16* signed_sin, float* x) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const auto* c = reinterpret_cast<const uint16_t*>(cos + r * d);
    const auto* s = reinterpret_cast<const uint16_t*>(signed_sin + r * d);
    for (int64_t h = 0; h < heads; ++h) {
      auto* v = reinterpret_cast<uint16_t*>(qkv + r * stride + h * d);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) x[i] = widen(v[i]);
#pragma omp simd
      for (int64_t i = 0; i < half; ++i)
        v[i] = narrow(round_bf16(x[i] * widen(c[i])) + round_bf16(x[i + half] * widen(s[i])));
#pragma omp simd
      for (int64_t i = half; i < d; ++i)
        v[i] = narrow(round_bf16(x[i] * widen(c[i])) + round_bf16(x[i - half] * widen(s[i])));
    }
  }
}

// h += y, rounded (a residual add in bfloat16).
void fused_add(Bf16* h, const Bf16* y, int64_t n) {
  auto* hb = reinterpret_cast<uint16_t*>(h);
  const auto* yb = reinterpret_cast<const uint16_t*>(y);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) hb[i] = narrow(widen(hb[i]) + widen(yb[i]));
}

// out[r] = bf16(silu(gate)) * up, rounded, from gate_up [rows, 2 * inter].
void fused_silu_mul(const Bf16* gate_up, Bf16* out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const Bf16* g = gate_up + r * 2 * inter;
    const Bf16* u = g + inter;
    Bf16* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float x = static_cast<float>(g[i]);
      o[i] = Bf16(round_bf16(x / (1.f + std::exp(-x))) * static_cast<float>(u[i]));
    }
  }
}

// The rows' k and v into their cache slots, from wherever each lies (row strides in elements).
void write_kv_rows(const Bf16* k, int64_t k_stride, const Bf16* v, int64_t v_stride, int64_t rows, int64_t size,
                   const int64_t* slots, const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t slots_in_cache = k_cache.numel() / size;
  Bf16* kc = k_cache.data_ptr<Bf16>();
  Bf16* vc = v_cache.data_ptr<Bf16>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slots[r] >= 0 && slots[r] < slots_in_cache, "kvscope: slot ", slots[r], " is not in the cache");
    std::memcpy(kc + slots[r] * size, k + r * k_stride, size * sizeof(Bf16));
    std::memcpy(vc + slots[r] * size, v + r * v_stride, size * sizeof(Bf16));
  }
}

// What every layer of a fused step shares: the step's inputs, its sizes, and buffers reused layer after layer.
struct FusedStep {
  const Tensor &cos, &signed_sin, &slots, &block_tables, &seq_lens, &seq_ids, &rows;
  int64_t q_size, kv_size, d, intermediate;
  Tensor x, attn, act;          // the normed input, attention's output, silu(gate) * up
  std::vector<float> rope_row;  // one head, widened
};

// One decode layer's work around its GEMMs in the loops above; h [t, width] is updated in place.
void fused_layer(Tensor& h, FusedStep& s, const Tensor* w, const int64_t* type, const std::optional<Tensor>* bias,
                 const double* e, const Tensor& k_cache, const Tensor& v_cache, double scaling, int64_t window) {
  const int64_t t = h.size(0), width = h.size(1), d = s.d, heads = s.q_size / d;
  const int64_t stride = s.q_size + 2 * s.kv_size;
  Bf16* hp = h.data_ptr<Bf16>();
  Bf16* xp = s.x.data_ptr<Bf16>();
  fused_rms_norm(hp, w[0].data_ptr<Bf16>(), xp, t, width, e[0]);
  Tensor qkv = linear(s.x, w[1], type[0], bias[0]).contiguous();
  Bf16* qp = qkv.data_ptr<Bf16>();
  fused_rope(qp, t, stride, heads + s.kv_size / d, d, s.cos.data_ptr<Bf16>(), s.signed_sin.data_ptr<Bf16>(),
             s.rope_row.data());
  write_kv_rows(qp + s.q_size, stride, qp + s.q_size + s.kv_size, stride, t, s.kv_size, s.slots.data_ptr<int64_t>(),
                k_cache, v_cache);
  const Tensor q = qkv.slice(1, 0, s.q_size).view({t, heads, d});
  paged_attention(q, s.attn, k_cache, v_cache, s.block_tables, s.seq_lens, s.seq_ids, s.rows, scaling, window);
  Tensor o = linear(s.attn.view({t, s.q_size}), w[2], type[1], bias[1]).contiguous();
  fused_add(hp, o.data_ptr<Bf16>(), t * width);
  fused_rms_norm(hp, w[3].data_ptr<Bf16>(), xp, t, width, e[1]);
  Tensor gate_up = linear(s.x, w[4], type[2], bias[2]).contiguous();
  fused_silu_mul(gate_up.data_ptr<Bf16>(), s.act.data_ptr<Bf16>(), t, s.intermediate);
  Tensor down = linear(s.act, w[5], type[3], bias[3]).contiguous();
  fused_add(hp, down.data_ptr<Bf16>(), t * width);
}

// kvscope::rope_: decoder.py's _rope in place on x [T, H, D] (bf16; each row's heads side by side, D
// contiguous), with cos and signed_sin [T, 1, D] bf16. For its prefill loop: one pass, no temporaries.
void rope_inplace(Tensor x, const Tensor& cos, const Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.size(2) % 2 == 0,
              "rope_: x must be bf16 [T, H, D], its heads side by side and D contiguous");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  auto table = [&](const Tensor& c, const char* name) {
    TORCH_CHECK(c.scalar_type() == at::kBFloat16 && c.is_contiguous() && c.numel() == t * d, "rope_: ", name,
                " must be bf16 [T, 1, D], contiguous");
    return c.data_ptr<Bf16>();
  };
  const Bf16 *c = table(cos, "cos"), *sn = table(signed_sin, "signed_sin");
  Bf16* base = x.data_ptr<Bf16>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, t, std::max<int64_t>(1, 4096 / (heads * d)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(d));
    fused_rope(base + begin * stride, end - begin, stride, heads, d, c + begin * d, sn + begin * d, row.data());
  });
}

// kvscope::write_kv: k and v [T, KVH, D] (bf16, each row's heads side by side) into the bf16 caches'
// slots, one memcpy a row (index_copy_ takes a slower path for the same bytes). Each slot is checked.
void write_kv(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache, const Tensor& slots) {
  auto rows_ok = [](const Tensor& x) {
    return x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 && x.stride(1) == x.size(2);
  };
  TORCH_CHECK(rows_ok(k) && rows_ok(v) && k.sizes() == v.sizes(), "write_kv: k and v must be bf16 [T, KVH, D]");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == at::kBFloat16,
              "write_kv: the caches must be bf16, contiguous, of one shape");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "write_kv: slot_mapping must be int64, one slot a row");
  const int64_t size = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.numel() % size == 0, "write_kv: the cache rows are not KVH * D wide");
  write_kv_rows(k.data_ptr<Bf16>(), k.stride(0), v.data_ptr<Bf16>(), v.stride(0), k.size(0), size,
                slots.data_ptr<int64_t>(), k_cache, v_cache);
}

// Whether the dense bf16 loop may do its rotary, cache writes and residual adds in the one-pass loops
// above: only those three, which round exactly where the ATen ops round (each product, each sum), so the
// bits stay transformers'. The norms and silu stay ATen's: their sums and exp are ATen's own.
bool exact_loops(const Tensor& h, const Tensor& cos, const Tensor& signed_sin, int64_t head_dim,
                 const Tensor& kv_cache, const Tensor& slots) {
  auto bf16 = [](const Tensor& x) { return x.scalar_type() == at::kBFloat16 && x.is_contiguous(); };
  return bf16(h) && bf16(kv_cache) && bf16(cos) && bf16(signed_sin) && slots.scalar_type() == at::kLong &&
         slots.is_contiguous() && slots.numel() == h.size(0) && cos.numel() == h.size(0) * head_dim &&
         signed_sin.numel() == cos.numel();
}

// Whether fused_layer can run this step: bfloat16 throughout, every linear on GGUF blocks, no q/k norms.
bool can_fuse(const Tensor& h, const Tensor& cos, const Tensor& signed_sin, int64_t head_dim, const Tensor& kv_cache,
              const Tensor& slots, at::IntArrayRef linear_types, const c10::List<std::optional<Tensor>>& optional,
              at::TensorList weights) {
  auto bf16 = [](const Tensor& x) { return x.scalar_type() == at::kBFloat16 && x.is_contiguous(); };
  if (!bf16(h) || !bf16(kv_cache) || slots.scalar_type() != at::kLong || !slots.is_contiguous()) return false;
  // cos/sin [T, 1, D]: one row per token, contiguous
  if (cos.scalar_type() != at::kBFloat16 || !cos.is_contiguous() || !signed_sin.is_contiguous() ||
      signed_sin.scalar_type() != at::kBFloat16 || cos.numel() != h.size(0) * head_dim ||
      signed_sin.numel() != cos.numel() || slots.numel() != h.size(0))
    return false;
  for (int64_t type : linear_types)
    if (!on_gguf_blocks(type)) return false;
  for (size_t i = 0; i < optional.size(); ++i) {
    const std::optional<Tensor> o = optional.get(i);
    if (!o.has_value()) continue;
    if (i % kOptionalPerLayer >= 4) return false;  // Qwen3's q/k norms: the ATen loop
    if (!bf16(*o)) return false;
  }
  for (size_t i = 0; i < weights.size(); i += kWeightsPerLayer)
    if (!bf16(weights[i]) || !bf16(weights[i + 3])) return false;  // the norms' weights
  return true;
}

// hidden [T, width] after the embedding -> hidden after the last layer (before the final norm).
Tensor decode_layers(const Tensor& hidden, const Tensor& cos, const Tensor& signed_sin, const Tensor& kv_cache,
                     const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
                     const Tensor& seq_ids, const Tensor& rows, at::TensorList weights,
                     at::IntArrayRef linear_types, const c10::List<std::optional<Tensor>>& optional, at::ArrayRef<double> eps,
                     at::ArrayRef<double> scaling, at::IntArrayRef windows, int64_t q_size, int64_t kv_size,
                     int64_t head_dim, int64_t intermediate, bool fused) {
  const int64_t layers = static_cast<int64_t>(scaling.size());
  TORCH_CHECK(hidden.dim() == 2, "decode_layers: hidden must be [T, width]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(linear_types.size()) == layers * kLinearsPerLayer &&
                  static_cast<int64_t>(optional.size()) == layers * kOptionalPerLayer &&
                  static_cast<int64_t>(eps.size()) == layers * kEpsPerLayer &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decode_layers: per-layer lists of unequal lengths");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) >= layers && kv_cache.is_contiguous(),
              "decode_layers: kv_cache must be [layers, 2, blocks, block_size, kv_heads, head_dim], contiguous");
  TORCH_CHECK(q_size % head_dim == 0 && kv_size % head_dim == 0, "decode_layers: sizes not in whole heads");
  const int64_t t = hidden.size(0), width = hidden.size(1), d = head_dim, heads = q_size / d, kv_heads = kv_size / d;
  if (fused && can_fuse(hidden, cos, signed_sin, d, kv_cache, slot_mapping, linear_types, optional, weights)) {
    FusedStep step{cos, signed_sin, slot_mapping, block_tables, seq_lens, seq_ids, rows, q_size, kv_size, d,
                   intermediate, at::empty_like(hidden), at::empty({t, heads, d}, hidden.options()),
                   at::empty({t, intermediate}, hidden.options()), std::vector<float>(static_cast<size_t>(d))};
    Tensor h = hidden.clone();
    for (int64_t i = 0; i < layers; ++i) {
      std::optional<Tensor> bias[4];
      for (int64_t j = 0; j < 4; ++j) bias[j] = optional.get(i * kOptionalPerLayer + j);
      const Tensor layer_cache = kv_cache.select(0, i);
      fused_layer(h, step, &weights[i * kWeightsPerLayer], &linear_types[i * kLinearsPerLayer], bias,
                  &eps[i * kEpsPerLayer], layer_cache.select(0, 0), layer_cache.select(0, 1), scaling[i], windows[i]);
    }
    return h;
  }
  const bool exact = exact_loops(hidden, cos, signed_sin, d, kv_cache, slot_mapping);
  std::vector<float> rope_row(static_cast<size_t>(d));
  Tensor h = exact ? hidden.clone() : hidden;  // exact: the residual adds go in place
  for (int64_t i = 0; i < layers; ++i) {
    const Tensor* w = &weights[i * kWeightsPerLayer];
    auto opt = [&](int64_t j) -> std::optional<Tensor> { return optional.get(i * kOptionalPerLayer + j); };
    const double* e = &eps[i * kEpsPerLayer];
    const int64_t* type = &linear_types[i * kLinearsPerLayer];
    const std::optional<Tensor> q_norm = opt(4), k_norm = opt(5);

    const Tensor qkv = linear(rms_norm(h, w[0], e[0]), w[1], type[0], opt(0)).contiguous();
    const Tensor layer_cache = kv_cache.select(0, i);
    const Tensor k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
    if (exact) {
      const int64_t stride = q_size + 2 * kv_size;
      Bf16* qp = qkv.data_ptr<Bf16>();
      const Bf16 *c = cos.data_ptr<Bf16>(), *sn = signed_sin.data_ptr<Bf16>();
      Tensor q = qkv.slice(1, 0, q_size).view({t, heads, d});
      Tensor k = qkv.slice(1, q_size, q_size + kv_size).view({t, kv_heads, d});
      if (!q_norm.has_value()) {  // q's and k's heads side by side in qkv: one rotary pass, in place
        fused_rope(qp, t, stride, heads + kv_heads, d, c, sn, rope_row.data());
      } else {
        q = rms_norm(q, *q_norm, e[2]).contiguous();
        k = rms_norm(k, *k_norm, e[3]).contiguous();
        fused_rope(q.data_ptr<Bf16>(), t, q_size, heads, d, c, sn, rope_row.data());
        fused_rope(k.data_ptr<Bf16>(), t, kv_size, kv_heads, d, c, sn, rope_row.data());
      }
      write_kv_rows(k.data_ptr<Bf16>(), k.stride(0), qp + q_size + kv_size, stride, t, kv_size,
                    slot_mapping.data_ptr<int64_t>(), k_cache, v_cache);
      Tensor attn = at::empty({t, heads, d}, qkv.options());
      paged_attention(q, attn, k_cache, v_cache, block_tables, seq_lens, seq_ids, rows, scaling[i], windows[i]);
      Bf16* hp = h.data_ptr<Bf16>();
      fused_add(hp, linear(attn.view({t, q_size}), w[2], type[1], opt(1)).contiguous().data_ptr<Bf16>(), t * width);
      const Tensor gate_up = linear(rms_norm(h, w[3], e[1]), w[4], type[2], opt(2));
      const auto parts = gate_up.split_with_sizes({intermediate, intermediate}, -1);
      fused_add(hp, linear(at::silu(parts[0]) * parts[1], w[5], type[3], opt(3)).contiguous().data_ptr<Bf16>(),
                t * width);
      continue;
    }
    Tensor q, k, v;
    if (!q_norm.has_value()) {  // q and k side by side in the fused output: one rotary pass for both
      const Tensor qk = rope(qkv.slice(1, 0, q_size + kv_size).view({t, -1, d}), cos, signed_sin);
      q = qk.slice(1, 0, heads);
      k = qk.slice(1, heads);
    } else {
      q = rope(rms_norm(qkv.slice(1, 0, q_size).view({t, -1, d}), *q_norm, e[2]), cos, signed_sin);
      k = rope(rms_norm(qkv.slice(1, q_size, q_size + kv_size).view({t, -1, d}), *k_norm, e[3]), cos,
               signed_sin);
    }
    v = qkv.slice(1, q_size + kv_size).view({t, -1, d});

    k_cache.view({-1, kv_heads, d}).index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));
    v_cache.view({-1, kv_heads, d}).index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
    Tensor attn = at::empty(q.sizes(), q.options());
    paged_attention(q, attn, k_cache, v_cache, block_tables, seq_lens, seq_ids, rows, scaling[i], windows[i]);

    h = h + linear(attn.reshape({t, -1}), w[2], type[1], opt(1));
    const Tensor gate_up = linear(rms_norm(h, w[3], e[1]), w[4], type[2], opt(2));
    const auto parts = gate_up.split_with_sizes({intermediate, intermediate}, -1);
    h = h + linear(at::silu(parts[0]) * parts[1], w[5], type[3], opt(3));
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor seq_ids, Tensor rows, Tensor[] weights, "
        "int[] linear_types, Tensor?[] optional, float[] eps, float[] scaling, int[] windows, int q_size, int kv_size, "
        "int head_dim, int intermediate, bool fused=False) -> Tensor");
}

// The packed weights are oneDNN tensors (dispatch key MkldnnCPU), which outrank CPU in dispatch.
TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_inplace);
  m.impl("write_kv", &write_kv);
}
TORCH_LIBRARY_IMPL(kvscope, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
