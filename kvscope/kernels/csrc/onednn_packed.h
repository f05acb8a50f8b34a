// A oneDNN-packed weight's buffer and size, through the ops torch registers for them: cpu_amx.cpp and
// cpu_dpbf16.cpp read the bytes oneDNN packed in place (cpu_linear.py packs them; no second copy).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>

namespace kvscope_onednn {

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

}  // namespace kvscope_onednn
