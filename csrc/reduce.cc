#include "reduce.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FUSIONRING_X86 1
#endif

namespace fusionring {
namespace {

struct Sum {
  template <typename T> static T apply(T a, T b) { return a + b; }
};
// Floating-point min and max give the same bits whichever operand is this rank's: ranks
// reduce in different orders (recursive doubling pairs (own, peer) on each side), and an
// order-dependent answer for NaN or for -0 against +0 would leave the replicas different.
// NaN wins, as in torch.minimum / torch.maximum; -0 is below +0.
template <typename T> inline T float_min(T a, T b) {
  if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
  if (a == b) return std::signbit(a) ? a : b;
  return b < a ? b : a;
}
template <typename T> inline T float_max(T a, T b) {
  if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
  if (a == b) return std::signbit(a) ? b : a;
  return a < b ? b : a;
}
struct Min {
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return float_min(a, b);
    } else {
      return b < a ? b : a;
    }
  }
};
struct Max {
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return float_max(a, b);
    } else {
      return a < b ? b : a;
    }
  }
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

#ifdef FUSIONRING_X86
// IEEE half through the F16C conversion instructions, 8 lanes at a time. Chosen at run
// time, so the library still runs on CPUs without F16C (the portable path above).
// Min and max match the scalar Op::apply: both operand orders, combined so that -0 is below
// +0 (OR / AND of the sign bits), and NaN wherever either lane is NaN.
__attribute__((target("avx,f16c"))) inline __m256 vec_apply(Sum, __m256 a, __m256 b) {
  return _mm256_add_ps(a, b);
}
__attribute__((target("avx,f16c"))) inline __m256 vec_apply(Min, __m256 a, __m256 b) {
  const __m256 m = _mm256_or_ps(_mm256_min_ps(a, b), _mm256_min_ps(b, a));
  return _mm256_blendv_ps(m, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}
__attribute__((target("avx,f16c"))) inline __m256 vec_apply(Max, __m256 a, __m256 b) {
  const __m256 m = _mm256_and_ps(_mm256_max_ps(a, b), _mm256_max_ps(b, a));
  return _mm256_blendv_ps(m, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}
__attribute__((target("avx,f16c"))) inline __m256 vec_apply(Prod, __m256 a, __m256 b) {
  return _mm256_mul_ps(a, b);
}

template <typename Op>
__attribute__((target("avx,f16c"))) void reduce_half_f16c(std::uint16_t* __restrict dst,
                                                           const std::uint16_t* __restrict src,
                                                           std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dst + i)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(vec_apply(Op{}, a, b), _MM_FROUND_TO_NEAREST_INT));
  }
  reduce_half<half_to_float, float_to_half, Op>(dst + i, src + i, n - i);
}

__attribute__((target("avx,f16c"))) void scale_half_f16c(std::uint16_t* __restrict buf,
                                                          std::size_t n, float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(buf + i),
                     _mm256_cvtps_ph(_mm256_mul_ps(a, f), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) buf[i] = float_to_half(half_to_float(buf[i]) * factor);
}

__attribute__((target("avx,f16c"))) void widen_half_f16c(const std::uint16_t* __restrict src,
                                                          float* __restrict dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

__attribute__((target("avx,f16c"))) void narrow_half_f16c(const float* __restrict src,
                                                           std::uint16_t* __restrict dst,
                                                           std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

inline bool cpu_has_f16c() { return cpu::has_f16c(); }
#endif

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
    case DType::kInt8:
      return reduce_native<std::int8_t, Op>(static_cast<std::int8_t*>(dst),
                                            static_cast<const std::int8_t*>(src), n);
    case DType::kInt16:
      return reduce_native<std::int16_t, Op>(static_cast<std::int16_t*>(dst),
                                             static_cast<const std::int16_t*>(src), n);
    case DType::kFloat16:
#ifdef FUSIONRING_X86
      if (cpu_has_f16c()) {
        return reduce_half_f16c<Op>(static_cast<std::uint16_t*>(dst),
                                    static_cast<const std::uint16_t*>(src), n);
      }
#endif
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

namespace {

template <typename T>
double squares_native(const T* __restrict v, std::size_t n) {
  // Four partial sums: the additions do not wait on each other, and at -O3 they vectorise.
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double x = static_cast<double>(v[i + k]);
      s[k] += x * x;
    }
  }
  for (; i < n; ++i) s[0] += static_cast<double>(v[i]) * static_cast<double>(v[i]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

template <float (*ToFloat)(std::uint16_t)>
double squares_half(const std::uint16_t* v, std::size_t n) {
  double s = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = ToFloat(v[i]);
    s += x * x;
  }
  return s;
}

}  // namespace

double sum_of_squares(const void* buf, std::size_t count, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return squares_native(static_cast<const float*>(buf), count);
    case DType::kFloat64: return squares_native(static_cast<const double*>(buf), count);
    case DType::kInt32: return squares_native(static_cast<const std::int32_t*>(buf), count);
    case DType::kInt64: return squares_native(static_cast<const std::int64_t*>(buf), count);
    case DType::kUInt8: return squares_native(static_cast<const std::uint8_t*>(buf), count);
    case DType::kInt8: return squares_native(static_cast<const std::int8_t*>(buf), count);
    case DType::kInt16: return squares_native(static_cast<const std::int16_t*>(buf), count);
    case DType::kFloat16: return squares_half<half_to_float>(static_cast<const std::uint16_t*>(buf), count);
    case DType::kBFloat16: return squares_half<bf16_to_float>(static_cast<const std::uint16_t*>(buf), count);
  }
  throw InvalidArgument("unknown dtype");
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
    case DType::kInt8:
      return scale_native<std::int8_t, double>(static_cast<std::int8_t*>(buf), count, factor);
    case DType::kInt16:
      return scale_native<std::int16_t, double>(static_cast<std::int16_t*>(buf), count, factor);
    case DType::kFloat16:
#ifdef FUSIONRING_X86
      if (cpu_has_f16c()) {
        return scale_half_f16c(static_cast<std::uint16_t*>(buf), count, static_cast<float>(factor));
      }
#endif
      return scale_half<half_to_float, float_to_half>(static_cast<std::uint16_t*>(buf), count,
                                                      static_cast<float>(factor));
    case DType::kBFloat16:
      return scale_half<bf16_to_float, float_to_bf16>(static_cast<std::uint16_t*>(buf), count,
                                                      static_cast<float>(factor));
  }
  throw InvalidArgument("unknown dtype");
}

void widen_to_float(const std::uint16_t* src, float* dst, std::size_t count, DType dtype) {
  if (dtype == DType::kBFloat16) {
    for (std::size_t i = 0; i < count; ++i) dst[i] = bf16_to_float(src[i]);
    return;
  }
  if (dtype != DType::kFloat16) throw InvalidArgument("widen_to_float: not a 16-bit float dtype");
#ifdef FUSIONRING_X86
  if (cpu_has_f16c()) return widen_half_f16c(src, dst, count);
#endif
  for (std::size_t i = 0; i < count; ++i) dst[i] = half_to_float(src[i]);
}

void narrow_from_float(const float* src, std::uint16_t* dst, std::size_t count, DType dtype) {
  if (dtype == DType::kBFloat16) {
    for (std::size_t i = 0; i < count; ++i) dst[i] = float_to_bf16(src[i]);
    return;
  }
  if (dtype != DType::kFloat16) throw InvalidArgument("narrow_from_float: not a 16-bit float dtype");
#ifdef FUSIONRING_X86
  if (cpu_has_f16c()) return narrow_half_f16c(src, dst, count);
#endif
  for (std::size_t i = 0; i < count; ++i) dst[i] = float_to_half(src[i]);
}

}  // namespace fusionring
