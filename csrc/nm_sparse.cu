// N:M selection on the GPU: one thread per element, one warp per 32 consecutive elements,
// so a warp holds 32/M whole groups (M divides 32). Each lane fetches the keys of its group's
// other members with warp shuffles, counts the rivals that beat it (larger key, or equal key
// at a lower index: the CPU rule of nm_sparse.h) and keeps itself when fewer than N do. The
// warp's ballot of kept lanes is its 32-bit mask word, which is the same bytes as the CPU's
// 64-bit little-endian words. Values land at (groups before the warp) * N + kept lanes below.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "nm_sparse_cuda.h"

namespace fusionring {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;

__device__ __forceinline__ std::uint32_t key_of(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

// The CPU conversions: round to nearest even (float16 NaN payloads may differ); bfloat16
// bit for bit, NaN stays quiet.
__device__ __forceinline__ std::uint16_t to_half_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ std::uint16_t to_bf16_bits(float x) {
  std::uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

struct F32 {
  using T = float;
  __device__ static T encode(float x) { return x; }
  __device__ static float decode(T v) { return v; }
};
struct F16 {
  using T = std::uint16_t;
  __device__ static T encode(float x) { return to_half_bits(x); }
  __device__ static float decode(T v) { return __half2float(__ushort_as_half(v)); }
};
struct BF16 {
  using T = std::uint16_t;
  __device__ static T encode(float x) { return to_bf16_bits(x); }
  __device__ static float decode(T v) {
    return __uint_as_float(static_cast<std::uint32_t>(v) << 16);
  }
};

// As on the CPU: a residual that is not finite is kept as 0, so one overflowing step does not
// spoil every later one.
__device__ __forceinline__ float finite_or_zero(float r) { return isfinite(r) ? r : 0.0f; }

// A kept value's rounding, or all of a value held back; 0 where the value is beyond the wire
// format's range (it arrives, or would arrive later, as inf) or the result is not finite.
template <class V>
__device__ __forceinline__ float residual_of(float x, bool keep) {
  const float sent = V::decode(V::encode(x));
  return isfinite(sent) ? finite_or_zero(keep ? x - sent : x) : 0.0f;
}

// Whether this lane's element is kept. Lanes past `count` have key 0 at higher indices than
// every real member of their group, so they never beat one (the tail keeps min(N, L)).
__device__ __forceinline__ bool lane_keeps(std::uint32_t key, int lane, int n, int m) {
  const int base = lane & ~(m - 1);
  const int mine = lane - base;
  int rank = 0;
  for (int d = 1; d < m; ++d) {
    const int other = (mine + d) & (m - 1);
    const std::uint32_t rival = __shfl_sync(kFull, key, base + other);
    rank += (rival > key) || (rival == key && other < mine);
  }
  return rank < n;
}

template <class V>
__global__ void select_kernel(const float* __restrict__ src, std::size_t count, int n, int m,
                              typename V::T* __restrict__ values, std::uint32_t* __restrict__ mask,
                              float* __restrict__ residual, bool want_values) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x & 31;
  const bool valid = i < count;
  const float x = valid ? src[i] : 0.0f;
  const bool keep = lane_keeps(valid ? key_of(x) : 0u, lane, n, m) && valid;
  const unsigned ballot = __ballot_sync(kFull, keep);
  const std::size_t warp_base = i - static_cast<std::size_t>(lane);
  if (lane == 0 && warp_base < count) mask[warp_base / 32] = ballot;
  if (!valid) return;
  if (keep && want_values) {
    const std::size_t at = warp_base / static_cast<std::size_t>(m) * static_cast<std::size_t>(n) +
                           static_cast<std::size_t>(__popc(ballot & ((1u << lane) - 1u)));
    values[at] = V::encode(x);
  }
  if (residual) residual[i] = residual_of<V>(x, keep);
}

template <class V>
__global__ void gather_kernel(const float* __restrict__ src, std::size_t count, int n, int m,
                              const std::uint32_t* __restrict__ mask,
                              typename V::T* __restrict__ values, float* __restrict__ residual) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int lane = threadIdx.x & 31;
  const unsigned word = mask[i / 32];
  const bool keep = (word >> lane) & 1u;
  const float x = src[i];
  if (keep) {
    const std::size_t at = (i - lane) / static_cast<std::size_t>(m) * static_cast<std::size_t>(n) +
                           static_cast<std::size_t>(__popc(word & ((1u << lane) - 1u)));
    values[at] = V::encode(x);
  }
  if (residual) residual[i] = residual_of<V>(x, keep);
}

template <class V>
__global__ void scatter_kernel(const typename V::T* __restrict__ values,
                               const std::uint32_t* __restrict__ mask, std::size_t count, int n,
                               int m, float* __restrict__ out, bool accumulate) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int lane = threadIdx.x & 31;
  const unsigned word = mask[i / 32];
  float v = 0.0f;
  if ((word >> lane) & 1u) {
    const std::size_t at = (i - lane) / static_cast<std::size_t>(m) * static_cast<std::size_t>(n) +
                           static_cast<std::size_t>(__popc(word & ((1u << lane) - 1u)));
    v = V::decode(values[at]);
    if (accumulate) out[i] += v;
  }
  if (!accumulate) out[i] = v;
}

void check_shape(int n, int m) {
  nm_check(n, m);
  if (32 % m != 0) {
    throw InvalidArgument("the CUDA N:M kernels need m dividing 32, not m=" + std::to_string(m));
  }
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

unsigned blocks_for(std::size_t count) {
  return static_cast<unsigned>((count + kThreads - 1) / kThreads);
}

template <class Fn>
void with_codec(DType t, Fn&& fn) {
  switch (t) {
    case DType::kFloat32: return fn(F32{});
    case DType::kFloat16: return fn(F16{});
    case DType::kBFloat16: return fn(BF16{});
    default: break;
  }
  throw InvalidArgument(std::string("N:M values must be float32, float16 or bfloat16, not ") +
                        dtype_name(t));
}

}  // namespace

void nm_compress_cuda(const float* src, std::size_t count, int n, int m, void* values,
                      DType value_dtype, std::uint64_t* mask, float* residual, void* stream) {
  check_shape(n, m);
  auto s = static_cast<cudaStream_t>(stream);
  if (count == 0) return;
  cudaMemsetAsync(mask, 0, nm_mask_words(count) * 8, s);  // the odd half of the last word
  with_codec(value_dtype, [&](auto codec) {
    using V = decltype(codec);
    select_kernel<V><<<blocks_for(count), kThreads, 0, s>>>(
        src, count, n, m, static_cast<typename V::T*>(values),
        reinterpret_cast<std::uint32_t*>(mask), residual, values != nullptr);
  });
  check_launch("nm_compress_cuda");
}

void nm_gather_cuda(const float* src, std::size_t count, int n, int m, const std::uint64_t* mask,
                    void* values, DType value_dtype, float* residual, void* stream) {
  check_shape(n, m);
  if (count == 0) return;
  with_codec(value_dtype, [&](auto codec) {
    using V = decltype(codec);
    gather_kernel<V><<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        src, count, n, m, reinterpret_cast<const std::uint32_t*>(mask),
        static_cast<typename V::T*>(values), residual);
  });
  check_launch("nm_gather_cuda");
}

void nm_scatter_cuda(const void* values, DType value_dtype, const std::uint64_t* mask,
                     std::size_t count, int n, int m, float* out, bool accumulate, void* stream) {
  check_shape(n, m);
  if (count == 0) return;
  with_codec(value_dtype, [&](auto codec) {
    using V = decltype(codec);
    scatter_kernel<V><<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const typename V::T*>(values), reinterpret_cast<const std::uint32_t*>(mask),
        count, n, m, out, accumulate);
  });
  check_launch("nm_scatter_cuda");
}

}  // namespace fusionring
