// What cpu_amx.cpp and cpu_dpbf16.cpp share: both read a bf16 weight in the bytes oneDNN packed, in place
// (cpu_linear.py packs them; no second copy), laid out in column groups of k-pairs, and both are called as
// y = x W^T + b on a few rows of x.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

namespace kvscope_onednn {

// A oneDNN-packed weight's buffer and size, through the ops torch registers for them.
inline const uint16_t* onednn_data(const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "").typed<int64_t(const at::Tensor&)>();
  return reinterpret_cast<const uint16_t*>(op.call(packed));
}

inline int64_t onednn_nbytes(const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "").typed<int64_t(const at::Tensor&)>();
  return op.call(packed);
}

// Whether packed's bytes are dense [n, k] (checked: bf16, that shape) laid out as
// [n/cols][k/depth][depth/2 k-pairs][cols][2], exactly: AMX's B tiles are cols 32, depth 32; the AVX-512 BF16
// panels cols 64, depth 2. `op` names the caller in the error.
inline bool pair_blocks_match(const char* op, const at::Tensor& packed, const at::Tensor& dense, int64_t n, int64_t k,
                              int64_t cols, int64_t depth) {
  TORCH_CHECK(dense.dim() == 2 && dense.size(0) == n && dense.size(1) == k && dense.scalar_type() == at::kBFloat16,
              op, ": the dense weight must be bf16 [", n, ", ", k, "]");
  const at::Tensor w = dense.contiguous();
  const uint16_t* blocks = onednn_data(packed);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  std::atomic<bool> same{true};
  at::parallel_for(0, n / cols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end && same.load(std::memory_order_relaxed); ++nb)
      for (int64_t kb = 0; kb < k / depth; ++kb) {
        const uint16_t* blk = blocks + (nb * (k / depth) + kb) * cols * depth;
        for (int64_t p = 0; p < depth / 2; ++p)
          for (int64_t c = 0; c < cols; ++c)
            for (int64_t e = 0; e < 2; ++e)
              if (blk[(p * cols + c) * 2 + e] != src[(nb * cols + c) * k + kb * depth + 2 * p + e]) {
                same = false;
                return;
              }
      }
  });
  return same;
}

// One call's x as [m, k] contiguous bf16 rows, its output [..., n] (uninitialised), and the bias in float32.
struct LinearCall {
  int64_t m = 0;
  at::Tensor x, out;
  std::optional<at::Tensor> bias;
};

// Checks x (bf16 [..., k]) and, where there are rows, the bias (n values); `op` names the caller in the errors.
inline LinearCall linear_call(const char* op, const at::Tensor& x, int64_t n, int64_t k,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == k, op, ": x must be bf16 [..., ", k, "]");
  LinearCall call;
  call.m = x.numel() / k;
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = n;
  call.out = at::empty(out_sizes, x.options());
  if (call.m == 0) return call;
  call.x = x.reshape({call.m, k}).contiguous();
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias must have ", n, " values");
    call.bias = bias->to(at::kFloat).contiguous();
  }
  return call;
}

}  // namespace kvscope_onednn
