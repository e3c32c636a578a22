// Element-wise reduction kernels over raw buffers; fp16/bf16 accumulate in fp32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtype.h"

namespace fusionring {

// dst[i] = dst[i] (op) src[i] for i < count.
void reduce_into(void* dst, const void* src, std::size_t count, DType dtype, ReduceOp op);

// buf[i] *= factor (computed in double for 64-bit types, in float otherwise; integers
// are truncated toward zero).
void scale_in_place(void* buf, std::size_t count, DType dtype, double factor);

// Sum of buf[i]^2 for i < count, accumulated in double (any dtype; 16-bit floats widened).
double sum_of_squares(const void* buf, std::size_t count, DType dtype);

// 16-bit floats (kFloat16 or kBFloat16) to float32 and back, rounding to nearest even.
void widen_to_float(const std::uint16_t* src, float* dst, std::size_t count, DType dtype);
void narrow_from_float(const float* src, std::uint16_t* dst, std::size_t count, DType dtype);

}  // namespace fusionring
