#include "reduce.h"

#include <algorithm>
#include <cstdint>

namespace fusionring {
namespace {

struct Sum {
  template <typename T> static T apply(T a, T b) { return a + b; }
};
struct Min {
  template <typename T> static T apply(T a, T b) { return b < a ? b : a; }
};
struct Max {
  template <typename T> static T apply(T a, T b) { return a < b ? b : a; }
};
struct Prod {
  template <typename T> static T apply(T a, T b) { return a * b; }
};

// Plain loops over __restrict pointers: GCC/Clang vectorise these at -O3.
template <typename T, typename Op>
void reduce_native(T* __restrict dst, const T* __restrict src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = Op::apply(dst[i], src[i]);
}

// 16-bit floats: widen a block to fp32, reduce there, narrow back.
template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float), typename Op>
void reduce_half(std::uint16_t* __restrict dst, const std::uint16_t* __restrict src, std::size_t n) {
  constexpr std::size_t kBlock = 256;
  float a[kBlock], b[kBlock];
  for (std::size_t base = 0; base < n; base += kBlock) {
    const std::size_t m = std::min(kBlock, n - base);
    for (std::size_t i = 0; i < m; ++i) a[i] = ToFloat(dst[base + i]);
    for (std::size_t i = 0; i < m; ++i) b[i] = ToFloat(src[base + i]);
    for (std::size_t i = 0; i < m; ++i) a[i] = Op::apply(a[i], b[i]);
    for (std::size_t i = 0; i < m; ++i) dst[base + i] = FromFloat(a[i]);
  }
}

template <typename Op>
void reduce_dispatch(void* dst, const void* src, std::size_t n, DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return reduce_native<float, Op>(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DType::kFloat64:
      return reduce_native<double, Op>(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case DType::kInt32:
      return reduce_native<std::int32_t, Op>(static_cast<std::int32_t*>(dst),
                                             static_cast<const std::int32_t*>(src), n);
    case DType::kInt64:
      return reduce_native<std::int64_t, Op>(static_cast<std::int64_t*>(dst),
                                             static_cast<const std::int64_t*>(src), n);
    case DType::kUInt8:
      return reduce_native<std::uint8_t, Op>(static_cast<std::uint8_t*>(dst),
                                             static_cast<const std::uint8_t*>(src), n);
    case DType::kFloat16:
      return reduce_half<half_to_float, float_to_half, Op>(
          static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), n);
    case DType::kBFloat16:
      return reduce_half<bf16_to_float, float_to_bf16, Op>(
          static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), n);
  }
  throw InvalidArgument("unknown dtype");
}

template <typename T, typename F>
void scale_native(T* __restrict buf, std::size_t n, F factor) {
  for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(static_cast<F>(buf[i]) * factor);
}

template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float)>
void scale_half(std::uint16_t* __restrict buf, std::size_t n, float factor) {
  for (std::size_t i = 0; i < n; ++i) buf[i] = FromFloat(ToFloat(buf[i]) * factor);
}

}  // namespace

void reduce_into(void* dst, const void* src, std::size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  switch (op) {
    case ReduceOp::kSum: return reduce_dispatch<Sum>(dst, src, count, dtype);
    case ReduceOp::kMin: return reduce_dispatch<Min>(dst, src, count, dtype);
    case ReduceOp::kMax: return reduce_dispatch<Max>(dst, src, count, dtype);
    case ReduceOp::kProduct: return reduce_dispatch<Prod>(dst, src, count, dtype);
  }
  throw InvalidArgument("unknown reduce op");
}

void scale_in_place(void* buf, std::size_t count, DType dtype, double factor) {
  if (count == 0 || factor == 1.0) return;
  switch (dtype) {
    case DType::kFloat32:
      return scale_native<float, float>(static_cast<float*>(buf), count, static_cast<float>(factor));
    case DType::kFloat64:
      return scale_native<double, double>(static_cast<double*>(buf), count, factor);
    case DType::kInt32:
      return scale_native<std::int32_t, double>(static_cast<std::int32_t*>(buf), count, factor);
    case DType::kInt64:
      return scale_native<std::int64_t, double>(static_cast<std::int64_t*>(buf), count, factor);
    case DType::kUInt8:
      return scale_native<std::uint8_t, double>(static_cast<std::uint8_t*>(buf), count, factor);
    case DType::kFloat16:
      return scale_half<half_to_float, float_to_half>(static_cast<std::uint16_t*>(buf), count,
                                                      static_cast<float>(factor));
    case DType::kBFloat16:
      return scale_half<bf16_to_float, float_to_bf16>(static_cast<std::uint16_t*>(buf), count,
                                                      static_cast<float>(factor));
  }
  throw InvalidArgument("unknown dtype");
}

}  // namespace fusionring
