#include "nm_sparse.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#include "cpu_features.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FR_NM_X86 1
#include <immintrin.h>
// The vector kernels are compiled for AVX2 + F16C only, and chosen at run time, so the module
// still loads on CPUs without them (the portable loops then give the same bits).
#define FR_AVX2 __attribute__((target("avx2,f16c,popcnt,bmi")))
#else
#define FR_NM_X86 0
#endif

namespace fusionring {
namespace {

// A residual that is not finite (a non-finite gradient, or a value beyond the wire format's
// range, which arrives as inf) is kept as 0: carried on, it would spoil every later step of
// its element, and a step that overflowed on purpose (a loss scaler's probe) must not. A
// value held back that is beyond the wire format's range is kept as 0 too: sent later, it
// would arrive as inf then.
inline float finite_or_zero(float r) { return std::isfinite(r) ? r : 0.0f; }

// ------------------------------------------------------------------ value codecs (scalar)
struct F32 {
  using T = float;
  static T encode(float x) { return x; }
  static float decode(T v) { return v; }
  static float residual(float) { return 0.0f; }  // a kept float32 value is sent exactly
  static float held(float x) { return finite_or_zero(x); }
};
struct F16 {
  using T = std::uint16_t;
  static T encode(float x) { return float_to_half(x); }
  static float decode(T v) { return half_to_float(v); }
  static float residual(float x) { return finite_or_zero(x - decode(encode(x))); }
  static float held(float x) { return std::isfinite(decode(encode(x))) ? x : 0.0f; }
};
struct BF16 {
  using T = std::uint16_t;
  static T encode(float x) { return float_to_bf16(x); }
  static float decode(T v) { return bf16_to_float(v); }
  static float residual(float x) { return finite_or_zero(x - decode(encode(x))); }
  static float held(float x) { return std::isfinite(decode(encode(x))) ? x : 0.0f; }
};

// Magnitude key: the bits of |x| as an unsigned integer (ordered like |x|; NaN above inf).
inline std::uint32_t key_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b & 0x7fffffffu;
}

inline bool bit_at(const std::uint64_t* mask, std::size_t i) {
  return (mask[i >> 6] >> (i & 63)) & 1u;
}

inline std::size_t popcount64(std::uint64_t w) {
  return static_cast<std::size_t>(__builtin_popcountll(w));
}


// ------------------------------------------------------------------ portable paths
// Keep bits of one group of L <= 32 elements: element i is kept when fewer than n elements
// beat it (larger key, or equal key at a lower index).
inline std::uint32_t group_keep(const float* x, int L, int n) {
  if (n >= L) return L == 32 ? 0xffffffffu : ((1u << L) - 1u);
  std::uint32_t k[kNmMaxM];
  for (int i = 0; i < L; ++i) k[i] = key_of(x[i]);
  std::uint32_t bits = 0;
  for (int i = 0; i < L; ++i) {
    int rank = 0;
    for (int j = 0; j < i; ++j) rank += k[j] >= k[i];
    for (int j = i + 1; j < L; ++j) rank += k[j] > k[i];
    bits |= static_cast<std::uint32_t>(rank < n) << i;
  }
  return bits;
}

// ORs `L` bits into the stream at bit `pos` (a group may straddle two words when M does not
// divide 64).
inline void put_bits(std::uint64_t* mask, std::size_t pos, std::uint32_t bits, int L) {
  const std::size_t w = pos >> 6;
  const unsigned s = static_cast<unsigned>(pos & 63);
  mask[w] |= static_cast<std::uint64_t>(bits) << s;
  if (s + static_cast<unsigned>(L) > 64) {
    mask[w + 1] |= static_cast<std::uint64_t>(bits) >> (64 - s);
  }
}

// Mask bits of the groups starting at element `begin` (a group boundary) up to `count`.
void select_mask_scalar(const float* x, std::size_t begin, std::size_t count, int n, int m,
                        std::uint64_t* mask) {
  for (std::size_t e = begin; e < count; e += static_cast<std::size_t>(m)) {
    const int L = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(m), count - e));
    put_bits(mask, e, group_keep(x + e, L, n), L);
  }
}

// Packs the masked elements of [begin, count) (values written from `out`), and the residual.
template <class V>
std::size_t compact_scalar(const float* x, std::size_t begin, std::size_t count,
                           const std::uint64_t* mask, typename V::T* out, float* residual) {
  std::size_t o = 0;
  for (std::size_t w = begin >> 6; w * 64 < count; ++w) {
    const std::size_t base = w * 64;
    std::uint64_t bits = mask[w];
    if (base < begin) bits &= ~0ull << (begin - base);
    if (count - base < 64) bits &= (1ull << (count - base)) - 1u;
    while (bits) {
      const int i = __builtin_ctzll(bits);
      out[o++] = V::encode(x[base + static_cast<std::size_t>(i)]);
      bits &= bits - 1u;
    }
  }
  if (residual) {
    for (std::size_t i = begin; i < count; ++i) {
      const float xi = x[i];
      residual[i] = bit_at(mask, i) ? V::residual(xi) : V::held(xi);
    }
  }
  return o;
}

template <class V, bool Add>
std::size_t scatter_scalar(const typename V::T* values, const std::uint64_t* mask,
                           std::size_t begin, std::size_t count, float* out) {
  std::size_t o = 0;
  for (std::size_t i = begin; i < count; ++i) {
    if (bit_at(mask, i)) {
      const float v = V::decode(values[o++]);
      out[i] = Add ? out[i] + v : v;
    } else if (!Add) {
      out[i] = 0.0f;
    }
  }
  return o;
}

// ------------------------------------------------------------------ AVX2 paths
#if FR_NM_X86
struct Lut {
  alignas(32) std::int32_t idx[256][8];
};
// compress: lanes of the set bits, in order, moved to the front.
// expand: each set lane takes the index of its value among the packed ones.
constexpr Lut make_lut(bool expand) {
  Lut t{};
  for (int b = 0; b < 256; ++b) {
    int k = 0;
    for (int i = 0; i < 8; ++i) {
      if (b & (1 << i)) {
        if (expand) t.idx[b][i] = k; else t.idx[b][k] = i;
        ++k;
      }
    }
  }
  return t;
}
constexpr Lut kCompressLut = make_lut(false);
constexpr Lut kExpandLut = make_lut(true);

// All ones in the lanes of r that are finite.
FR_AVX2 inline __m256 finite_lanes8(__m256 r) {
  const __m256 magnitude = _mm256_and_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_cmp_ps(magnitude, _mm256_set1_ps(HUGE_VALF), _CMP_LT_OQ);
}
// finite_or_zero, eight lanes at a time.
FR_AVX2 inline __m256 finite8(__m256 r) { return _mm256_and_ps(r, finite_lanes8(r)); }

template <class V> struct Vec;
template <> struct Vec<F32> {
  FR_AVX2 static void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  FR_AVX2 static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  FR_AVX2 static __m256 residual(__m256 x, __m256 keep) {
    return finite8(_mm256_andnot_ps(keep, x));
  }
};
template <> struct Vec<F16> {
  FR_AVX2 static __m128i narrow(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  FR_AVX2 static void store8(std::uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(v));
  }
  FR_AVX2 static __m256 load8(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  FR_AVX2 static __m256 residual(__m256 x, __m256 keep) {  // kept: x - sent; held: V::held
    const __m256 sent = _mm256_cvtph_ps(narrow(x));
    return _mm256_and_ps(finite8(_mm256_sub_ps(x, _mm256_and_ps(sent, keep))),
                         finite_lanes8(sent));
  }
};
template <> struct Vec<BF16> {
  // Round to nearest even; NaN stays a quiet NaN (as float_to_bf16).
  FR_AVX2 static __m128i narrow(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  FR_AVX2 static __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  FR_AVX2 static void store8(std::uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow(v));
  }
  FR_AVX2 static __m256 load8(const std::uint16_t* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  FR_AVX2 static __m256 residual(__m256 x, __m256 keep) {  // kept: x - sent; held: V::held
    const __m256 sent = widen(narrow(x));
    return _mm256_and_ps(finite8(_mm256_sub_ps(x, _mm256_and_ps(sent, keep))),
                         finite_lanes8(sent));
  }
};

// Selection for M in {2, 4, 8}: eight lanes hold 8/M whole groups; rotating each group by
// d = 1..M-1 puts every rival of a lane beside it. A rival beats the lane on a larger key, or
// on an equal key when it sits at a lower index (the rotation wrapped). Runs while `total`
// leaves room for a full 8-value store; returns the elements and values done.
template <int M, class V>
FR_AVX2 void select_avx2(const float* x, std::size_t count, int n, typename V::T* values,
                         std::uint64_t* mask, float* residual, std::size_t total,
                         std::size_t& e_done, std::size_t& o_done) {
  static_assert(M == 2 || M == 4 || M == 8, "vector selection handles M in {2, 4, 8}");
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i in_group = _mm256_and_si256(lane, _mm256_set1_epi32(M - 1));
  const __m256i group_base = _mm256_and_si256(lane, _mm256_set1_epi32(~(M - 1)));
  __m256i perm[M - 1], wrap[M - 1];
  for (int d = 1; d < M; ++d) {
    perm[d - 1] = _mm256_or_si256(
        group_base, _mm256_and_si256(_mm256_add_epi32(lane, _mm256_set1_epi32(d)),
                                     _mm256_set1_epi32(M - 1)));
    // 1 where the rival sits at a lower index (the rotation wrapped): it wins ties there.
    wrap[d - 1] = _mm256_srli_epi32(
        _mm256_cmpgt_epi32(_mm256_add_epi32(in_group, _mm256_set1_epi32(d)),
                           _mm256_set1_epi32(M - 1)), 31);
  }
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  const __m256i neg_n = _mm256_set1_epi32(-n);
  const bool want_values = values != nullptr;
  std::size_t e = 0, o = 0;
  std::uint64_t word = 0;
  for (; e + 8 <= count && (!want_values || o + 8 <= total); e += 8) {
    const __m256 xv = _mm256_loadu_ps(x + e);
    const __m256i k = _mm256_and_si256(_mm256_castps_si256(xv), absmask);
    __m256i neg_rank = _mm256_setzero_si256();
    for (int d = 0; d < M - 1; ++d) {
      // rival > k, or rival >= k when it wins ties: rival > k - tie (keys are < 2^31).
      const __m256i rival = _mm256_permutevar8x32_epi32(k, perm[d]);
      const __m256i beats = _mm256_cmpgt_epi32(rival, _mm256_sub_epi32(k, wrap[d]));
      neg_rank = _mm256_add_epi32(neg_rank, beats);  // a true compare is -1
    }
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(neg_rank, neg_n));
    const unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(keep));
    word |= static_cast<std::uint64_t>(bits) << (e & 63);
    if ((e & 63) == 56) {
      mask[e >> 6] = word;
      word = 0;
    }
    if (want_values) {
      const __m256i idx =
          _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompressLut.idx[bits]));
      Vec<V>::store8(values + o, _mm256_permutevar8x32_ps(xv, idx));
      o += static_cast<std::size_t>(_mm_popcnt_u32(bits));
      if (residual) _mm256_storeu_ps(residual + e, Vec<V>::residual(xv, keep));
    }
  }
  if (e & 63) mask[e >> 6] = word;
  e_done = e;
  o_done = o;
}

// Selection for M in {16, 32}: a group spans M/8 vectors; each member's key is broadcast in
// turn and compared with the whole group (equal keys: the member wins over later lanes).
template <int M, class V>
FR_AVX2 void select_wide_avx2(const float* x, std::size_t count, int n, typename V::T* values,
                              std::uint64_t* mask, float* residual, std::size_t total,
                              std::size_t& e_done, std::size_t& o_done) {
  static_assert(M == 16 || M == 32, "wide vector selection handles M in {16, 32}");
  constexpr int G = M / 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  const __m256i neg_n = _mm256_set1_epi32(-n);
  const bool want_values = values != nullptr;
  std::size_t e = 0, o = 0;
  for (; e + M <= count && (!want_values || o + M <= total); e += M) {
    __m256 xv[G];
    __m256i k[G], neg_rank[G];
    for (int h = 0; h < G; ++h) {
      xv[h] = _mm256_loadu_ps(x + e + 8 * h);
      k[h] = _mm256_and_si256(_mm256_castps_si256(xv[h]), absmask);
      neg_rank[h] = _mm256_setzero_si256();
    }
    for (int j = 0; j < M; ++j) {
      const __m256i kj = _mm256_permutevar8x32_epi32(k[j / 8], _mm256_set1_epi32(j % 8));
      for (int h = 0; h < G; ++h) {
        // member j beats later lanes on ties: kj > k - (lane > j)
        const __m256i later = _mm256_cmpgt_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8 * h)),
                                                 _mm256_set1_epi32(j));
        const __m256i beats = _mm256_cmpgt_epi32(kj, _mm256_add_epi32(k[h], later));
        neg_rank[h] = _mm256_add_epi32(neg_rank[h], beats);
      }
    }
    std::uint64_t group_bits = 0;
    for (int h = 0; h < G; ++h) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(neg_rank[h], neg_n));
      const unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(keep));
      group_bits |= static_cast<std::uint64_t>(bits) << (8 * h);
      if (want_values) {
        const __m256i idx =
            _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompressLut.idx[bits]));
        Vec<V>::store8(values + o, _mm256_permutevar8x32_ps(xv[h], idx));
        o += static_cast<std::size_t>(_mm_popcnt_u32(bits));
        if (residual) _mm256_storeu_ps(residual + e + 8 * h, Vec<V>::residual(xv[h], keep));
      }
    }
    mask[e >> 6] |= group_bits << (e & 63);
  }
  e_done = e;
  o_done = o;
}

FR_AVX2 inline __m256 lanes_of(unsigned bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel));
}

template <class V>
FR_AVX2 void gather_avx2(const float* x, std::size_t count, const std::uint64_t* mask,
                         typename V::T* values, float* residual, std::size_t total,
                         std::size_t& e_done, std::size_t& o_done) {
  std::size_t e = 0, o = 0;
  for (; e + 8 <= count && o + 8 <= total; e += 8) {
    const unsigned bits = static_cast<unsigned>((mask[e >> 6] >> (e & 63)) & 0xffu);
    const __m256 xv = _mm256_loadu_ps(x + e);
    const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompressLut.idx[bits]));
    Vec<V>::store8(values + o, _mm256_permutevar8x32_ps(xv, idx));
    o += static_cast<std::size_t>(_mm_popcnt_u32(bits));
    if (residual) _mm256_storeu_ps(residual + e, Vec<V>::residual(xv, lanes_of(bits)));
  }
  e_done = e;
  o_done = o;
}

template <class V, bool Add>
FR_AVX2 void scatter_avx2(const typename V::T* values, const std::uint64_t* mask,
                          std::size_t count, float* out, std::size_t total, std::size_t& e_done,
                          std::size_t& o_done) {
  std::size_t e = 0, o = 0;
  for (; e + 8 <= count && o + 8 <= total; e += 8) {
    const unsigned bits = static_cast<unsigned>((mask[e >> 6] >> (e & 63)) & 0xffu);
    const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(kExpandLut.idx[bits]));
    const __m256 lanes = lanes_of(bits);
    const __m256 v = _mm256_and_ps(_mm256_permutevar8x32_ps(Vec<V>::load8(values + o), idx), lanes);
    if (Add) {
      const __m256 old = _mm256_loadu_ps(out + e);
      _mm256_storeu_ps(out + e, _mm256_blendv_ps(old, _mm256_add_ps(old, v), lanes));
    } else {
      _mm256_storeu_ps(out + e, v);
    }
    o += static_cast<std::size_t>(_mm_popcnt_u32(bits));
  }
  e_done = e;
  o_done = o;
}

// ------------------------------------------------------------------ AVX-512 paths
// Sixteen lanes and mask registers: ranks count with masked subtracts, kept values are packed
// with an in-register compress and written with a masked store (so no store runs past the
// kept values and the loops need no room check), and decode expands in register.
#define FR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,popcnt,bmi")))

// The lanes of r that are finite.
FR_AVX512 inline __mmask16 finite_lanes16(__m512 r) {
  return _mm512_cmp_ps_mask(_mm512_abs_ps(r), _mm512_set1_ps(HUGE_VALF), _CMP_LT_OQ);
}
// finite_or_zero, sixteen lanes at a time.
FR_AVX512 inline __m512 finite16(__m512 r) { return _mm512_maskz_mov_ps(finite_lanes16(r), r); }

template <class V> struct Vec512;
template <> struct Vec512<F32> {
  FR_AVX512 static void store(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
  FR_AVX512 static __m512 load(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
  FR_AVX512 static __m512 residual(__m512 x, __mmask16 keep) {
    return finite16(_mm512_maskz_mov_ps(static_cast<__mmask16>(~keep), x));
  }
};
template <> struct Vec512<F16> {
  FR_AVX512 static __m256i narrow(__m512 v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  FR_AVX512 static void store(std::uint16_t* p, __m512 v, __mmask16 k) {
    _mm256_mask_storeu_epi16(p, k, narrow(v));
  }
  FR_AVX512 static __m512 load(const std::uint16_t* p, __mmask16 k) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
  }
  FR_AVX512 static __m512 residual(__m512 x, __mmask16 keep) {  // kept: x - sent; held: V::held
    const __m512 sent = _mm512_cvtph_ps(narrow(x));
    return _mm512_maskz_mov_ps(finite_lanes16(sent),
                               finite16(_mm512_sub_ps(x, _mm512_maskz_mov_ps(keep, sent))));
  }
};
template <> struct Vec512<BF16> {
  FR_AVX512 static __m256i narrow(__m512 v) {  // as float_to_bf16, in integer lanes
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
  }
  FR_AVX512 static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  FR_AVX512 static void store(std::uint16_t* p, __m512 v, __mmask16 k) {
    _mm256_mask_storeu_epi16(p, k, narrow(v));
  }
  FR_AVX512 static __m512 load(const std::uint16_t* p, __mmask16 k) {
    return widen(_mm256_maskz_loadu_epi16(k, p));
  }
  FR_AVX512 static __m512 residual(__m512 x, __mmask16 keep) {  // kept: x - sent; held: V::held
    const __m512 sent = widen(narrow(x));
    return _mm512_maskz_mov_ps(finite_lanes16(sent),
                               finite16(_mm512_sub_ps(x, _mm512_maskz_mov_ps(keep, sent))));
  }
};

FR_AVX512 inline __mmask16 first_lanes(unsigned k) {
  return static_cast<__mmask16>((1u << k) - 1u);
}

// Packs the kept lanes of 16 elements at values + o and writes their residual.
template <class V>
FR_AVX512 inline void pack16_avx512(__m512 xv, __mmask16 keep, typename V::T* values,
                                    std::size_t& o, float* residual) {
  const unsigned kept = static_cast<unsigned>(_mm_popcnt_u32(keep));
  Vec512<V>::store(values + o, _mm512_maskz_compress_ps(keep, xv), first_lanes(kept));
  o += kept;
  if (residual) _mm512_storeu_ps(residual, Vec512<V>::residual(xv, keep));
}

// M in {2, 4, 8, 16}: rotations within each group, as the AVX2 kernel.
template <int M, class V>
FR_AVX512 void select_avx512(const float* x, std::size_t count, int n, typename V::T* values,
                             std::uint64_t* mask, float* residual, std::size_t& e_done,
                             std::size_t& o_done) {
  static_assert(M == 2 || M == 4 || M == 8 || M == 16, "rotation selection handles M <= 16");
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i in_group = _mm512_and_si512(lane, _mm512_set1_epi32(M - 1));
  const __m512i group_base = _mm512_and_si512(lane, _mm512_set1_epi32(~(M - 1)));
  __m512i perm[M - 1], wrap[M - 1];
  for (int d = 1; d < M; ++d) {
    perm[d - 1] = _mm512_or_si512(
        group_base, _mm512_and_si512(_mm512_add_epi32(lane, _mm512_set1_epi32(d)),
                                     _mm512_set1_epi32(M - 1)));
    wrap[d - 1] = _mm512_maskz_mov_epi32(
        _mm512_cmpgt_epi32_mask(_mm512_add_epi32(in_group, _mm512_set1_epi32(d)),
                                _mm512_set1_epi32(M - 1)),
        _mm512_set1_epi32(1));
  }
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  const __m512i neg_n = _mm512_set1_epi32(-n);
  const __m512i one = _mm512_set1_epi32(1);
  std::size_t e = 0, o = 0;
  std::uint64_t word = 0;
  for (; e + 16 <= count; e += 16) {
    const __m512 xv = _mm512_loadu_ps(x + e);
    const __m512i k = _mm512_and_si512(_mm512_castps_si512(xv), absmask);
    __m512i neg_rank = _mm512_setzero_si512();
    for (int d = 0; d < M - 1; ++d) {
      const __m512i rival = _mm512_permutexvar_epi32(perm[d], k);
      const __mmask16 beats = _mm512_cmpgt_epi32_mask(rival, _mm512_sub_epi32(k, wrap[d]));
      neg_rank = _mm512_mask_sub_epi32(neg_rank, beats, neg_rank, one);
    }
    const __mmask16 keep = _mm512_cmpgt_epi32_mask(neg_rank, neg_n);
    word |= static_cast<std::uint64_t>(keep) << (e & 63);
    if ((e & 63) == 48) {
      mask[e >> 6] = word;
      word = 0;
    }
    if (values) pack16_avx512<V>(xv, keep, values, o, residual ? residual + e : nullptr);
  }
  if (e & 63) mask[e >> 6] = word;
  e_done = e;
  o_done = o;
}

template <class V>
FR_AVX512 void gather_avx512(const float* x, std::size_t count, const std::uint64_t* mask,
                             typename V::T* values, float* residual, std::size_t& e_done,
                             std::size_t& o_done) {
  std::size_t e = 0, o = 0;
  for (; e + 16 <= count; e += 16) {
    const __mmask16 keep = static_cast<__mmask16>((mask[e >> 6] >> (e & 63)) & 0xffffu);
    pack16_avx512<V>(_mm512_loadu_ps(x + e), keep, values, o, residual ? residual + e : nullptr);
  }
  e_done = e;
  o_done = o;
}

template <class V, bool Add>
FR_AVX512 void scatter_avx512(const typename V::T* values, const std::uint64_t* mask,
                              std::size_t count, float* out, std::size_t& e_done,
                              std::size_t& o_done) {
  std::size_t e = 0, o = 0;
  for (; e + 16 <= count; e += 16) {
    const __mmask16 keep = static_cast<__mmask16>((mask[e >> 6] >> (e & 63)) & 0xffffu);
    const unsigned kept = static_cast<unsigned>(_mm_popcnt_u32(keep));
    const __m512 v = _mm512_maskz_expand_ps(keep, Vec512<V>::load(values + o, first_lanes(kept)));
    if (Add) {
      const __m512 old = _mm512_loadu_ps(out + e);
      _mm512_storeu_ps(out + e, _mm512_mask_add_ps(old, keep, old, v));
    } else {
      _mm512_storeu_ps(out + e, v);
    }
    o += kept;
  }
  e_done = e;
  o_done = o;
}

// Shared-mask bookkeeping, eight elements at a time (the division dominates otherwise).
FR_AVX2 std::size_t track_avx2(float* estimate, float* wait, const float* reduced,
                               const std::uint64_t* mask, std::size_t count) {
  const __m256 one = _mm256_set1_ps(1.0f);
  std::size_t e = 0;
  for (; e + 8 <= count; e += 8) {
    const unsigned bits = static_cast<unsigned>((mask[e >> 6] >> (e & 63)) & 0xffu);
    const __m256 w = _mm256_loadu_ps(wait + e);
    const __m256 w1 = _mm256_add_ps(w, one);
    if (bits == 0) {
      _mm256_storeu_ps(wait + e, w1);
      continue;
    }
    const __m256 sent = lanes_of(bits);
    const __m256 fresh = _mm256_div_ps(_mm256_loadu_ps(reduced + e), w1);
    _mm256_storeu_ps(estimate + e, _mm256_blendv_ps(_mm256_loadu_ps(estimate + e), fresh, sent));
    _mm256_storeu_ps(wait + e, _mm256_andnot_ps(sent, w1));
  }
  return e;
}

int cpu_vector_level() { return cpu::vector_level(); }
#else
int cpu_vector_level() { return 0; }
#endif

// 0: portable loops, 1: AVX2, 2: AVX-512.
std::atomic<int>& vector_level() {
  static std::atomic<int> level{cpu_vector_level()};
  return level;
}
inline int use_level() { return FR_NM_X86 ? vector_level().load(std::memory_order_relaxed) : 0; }

// ------------------------------------------------------------------ float32 drivers
void fill_ones(std::uint64_t* mask, std::size_t count) {
  const std::size_t words = nm_mask_words(count);
  for (std::size_t w = 0; w < words; ++w) mask[w] = ~0ull;
  if (count & 63) mask[words - 1] = (1ull << (count & 63)) - 1u;
}

template <class V>
std::size_t gather_f32(const float* x, std::size_t count, const std::uint64_t* mask,
                       typename V::T* values, float* residual) {
  std::size_t e = 0, o = 0;
#if FR_NM_X86
  const int level = use_level();
  if (level == 2) gather_avx512<V>(x, count, mask, values, residual, e, o);
  if (level == 1) {
    gather_avx2<V>(x, count, mask, values, residual, nm_mask_popcount(mask, count), e, o);
  }
#endif
  return o + compact_scalar<V>(x, e, count, mask, values + o, residual);
}

void select_mask_f32(const float* x, std::size_t count, int n, int m, std::uint64_t* mask) {
  std::memset(mask, 0, nm_mask_words(count) * 8);
  if (n >= m) return fill_ones(mask, count);
  std::size_t e = 0, o = 0;
#if FR_NM_X86
  const int level = use_level();
  float* none = nullptr;
  if (level == 2) {
    if (m == 2) select_avx512<2, F32>(x, count, n, none, mask, nullptr, e, o);
    if (m == 4) select_avx512<4, F32>(x, count, n, none, mask, nullptr, e, o);
    if (m == 8) select_avx512<8, F32>(x, count, n, none, mask, nullptr, e, o);
    if (m == 16) select_avx512<16, F32>(x, count, n, none, mask, nullptr, e, o);
  }
  // M = 32 (and any level-1 CPU) takes the AVX2 kernels: measured faster than 16 lanes there.
  if (level == 1 || (level == 2 && m == 32)) {
    if (m == 2) select_avx2<2, F32>(x, count, n, none, mask, nullptr, 0, e, o);
    if (m == 4) select_avx2<4, F32>(x, count, n, none, mask, nullptr, 0, e, o);
    if (m == 8) select_avx2<8, F32>(x, count, n, none, mask, nullptr, 0, e, o);
    if (m == 16) select_wide_avx2<16, F32>(x, count, n, none, mask, nullptr, 0, e, o);
    if (m == 32) select_wide_avx2<32, F32>(x, count, n, none, mask, nullptr, 0, e, o);
  }
#endif
  select_mask_scalar(x, e, count, n, m, mask);
}

template <class V>
std::size_t compress_f32(const float* x, std::size_t count, int n, int m, typename V::T* values,
                         std::uint64_t* mask, float* residual) {
  if (n >= m) {  // dense: every element kept
    std::memset(mask, 0, nm_mask_words(count) * 8);
    fill_ones(mask, count);
    return gather_f32<V>(x, count, mask, values, residual);
  }
  std::memset(mask, 0, nm_mask_words(count) * 8);
  std::size_t e = 0, o = 0;
#if FR_NM_X86
  const int level = use_level();
  if (level == 2) {
    if (m == 2) select_avx512<2, V>(x, count, n, values, mask, residual, e, o);
    if (m == 4) select_avx512<4, V>(x, count, n, values, mask, residual, e, o);
    if (m == 8) select_avx512<8, V>(x, count, n, values, mask, residual, e, o);
    if (m == 16) select_avx512<16, V>(x, count, n, values, mask, residual, e, o);
  }
  if (level == 1 || (level == 2 && m == 32)) {
    const std::size_t total = nm_kept_count(count, n, m);
    if (m == 2) select_avx2<2, V>(x, count, n, values, mask, residual, total, e, o);
    if (m == 4) select_avx2<4, V>(x, count, n, values, mask, residual, total, e, o);
    if (m == 8) select_avx2<8, V>(x, count, n, values, mask, residual, total, e, o);
    if (m == 16) select_wide_avx2<16, V>(x, count, n, values, mask, residual, total, e, o);
    if (m == 32) select_wide_avx2<32, V>(x, count, n, values, mask, residual, total, e, o);
  }
#endif
  select_mask_scalar(x, e, count, n, m, mask);
  return o + compact_scalar<V>(x, e, count, mask, values + o, residual);
}

template <class V, bool Add>
std::size_t scatter_f32(const typename V::T* values, const std::uint64_t* mask, std::size_t count,
                        float* out) {
  std::size_t e = 0, o = 0;
#if FR_NM_X86
  const int level = use_level();
  if (level == 2) scatter_avx512<V, Add>(values, mask, count, out, e, o);
  if (level == 1) {
    scatter_avx2<V, Add>(values, mask, count, out, nm_mask_popcount(mask, count), e, o);
  }
#endif
  return o + scatter_scalar<V, Add>(values + o, mask, e, count, out);
}

// ------------------------------------------------------------------ dtype plumbing
// 16-bit inputs are widened a block at a time; a block is a whole number of mask words and of
// groups, so each block is an independent float32 problem.
template <class Fn>
std::size_t over_f32_blocks(const void* src, DType t, std::size_t count, int m, Fn&& fn) {
  if (t == DType::kFloat32) return fn(static_cast<const float*>(src), count, std::size_t{0});
  constexpr std::size_t kTarget = 4096;
  const std::size_t unit = 64 * static_cast<std::size_t>(m);
  const std::size_t block = unit * std::max<std::size_t>(1, kTarget / unit);
  float buf[kTarget > 64 * kNmMaxM ? kTarget : 64 * kNmMaxM];
  const auto* h = static_cast<const std::uint16_t*>(src);
  std::size_t total = 0;
  for (std::size_t b = 0; b < count; b += block) {
    const std::size_t len = std::min(block, count - b);
    if (t == DType::kFloat16) {
      for (std::size_t i = 0; i < len; ++i) buf[i] = half_to_float(h[b + i]);
    } else {
      for (std::size_t i = 0; i < len; ++i) buf[i] = bf16_to_float(h[b + i]);
    }
    total += fn(buf, len, b);
  }
  return total;
}

template <class Fn>
auto with_value_codec(DType t, Fn&& fn) {
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

void nm_check(int n, int m) {
  if (m < 1 || m > kNmMaxM) {
    throw InvalidArgument("N:M group size m=" + std::to_string(m) + " must be in [1, " +
                          std::to_string(kNmMaxM) + "]");
  }
  if (n < 1 || n > m) {
    throw InvalidArgument("N:M kept count n=" + std::to_string(n) + " must be in [1, m=" +
                          std::to_string(m) + "]");
  }
}

void nm_check_float(DType t, const char* what) {
  if (t != DType::kFloat32 && t != DType::kFloat16 && t != DType::kBFloat16) {
    throw InvalidArgument(std::string(what) + " must be float32, float16 or bfloat16, not " +
                          dtype_name(t));
  }
}

std::size_t nm_kept_count(std::size_t count, int n, int m) {
  const std::size_t un = static_cast<std::size_t>(n), um = static_cast<std::size_t>(m);
  return count / um * un + std::min(un, count % um);
}

std::size_t nm_mask_popcount(const std::uint64_t* mask, std::size_t count) {
  const std::size_t full = count / 64;
  std::size_t total = 0;
  for (std::size_t w = 0; w < full; ++w) total += popcount64(mask[w]);
  if (count & 63) total += popcount64(mask[full] & ((1ull << (count & 63)) - 1u));
  return total;
}

std::size_t nm_compress(const void* src, DType src_dtype, std::size_t count, int n, int m,
                        void* values, DType value_dtype, std::uint64_t* mask, float* residual) {
  nm_check(n, m);
  nm_check_float(src_dtype, "N:M input");
  return with_value_codec(value_dtype, [&](auto codec) {
    using V = decltype(codec);
    auto* out = static_cast<typename V::T*>(values);
    std::size_t written = 0;
    over_f32_blocks(src, src_dtype, count, m, [&](const float* x, std::size_t len, std::size_t at) {
      const std::size_t k = compress_f32<V>(x, len, n, m, out + written, mask + at / 64,
                                            residual ? residual + at : nullptr);
      written += k;
      return k;
    });
    return written;
  });
}

void nm_select_mask(const void* src, DType src_dtype, std::size_t count, int n, int m,
                    std::uint64_t* mask) {
  nm_check(n, m);
  nm_check_float(src_dtype, "N:M input");
  over_f32_blocks(src, src_dtype, count, m, [&](const float* x, std::size_t len, std::size_t at) {
    select_mask_f32(x, len, n, m, mask + at / 64);
    return std::size_t{0};
  });
}

std::size_t nm_gather(const void* src, DType src_dtype, std::size_t count,
                      const std::uint64_t* mask, void* values, DType value_dtype, float* residual) {
  nm_check_float(src_dtype, "N:M input");
  return with_value_codec(value_dtype, [&](auto codec) {
    using V = decltype(codec);
    auto* out = static_cast<typename V::T*>(values);
    std::size_t written = 0;
    over_f32_blocks(src, src_dtype, count, 1, [&](const float* x, std::size_t len, std::size_t at) {
      const std::size_t k = gather_f32<V>(x, len, mask + at / 64, out + written,
                                          residual ? residual + at : nullptr);
      written += k;
      return k;
    });
    return written;
  });
}

std::size_t nm_scatter(const void* values, DType value_dtype, const std::uint64_t* mask,
                       std::size_t count, void* out, DType out_dtype) {
  nm_check_float(out_dtype, "N:M output");
  return with_value_codec(value_dtype, [&](auto codec) {
    using V = decltype(codec);
    const auto* in = static_cast<const typename V::T*>(values);
    if (out_dtype == DType::kFloat32) {
      return scatter_f32<V, false>(in, mask, count, static_cast<float*>(out));
    }
    // 16-bit outputs: decode a block into float32, then narrow it.
    constexpr std::size_t kBlock = 4096;
    float buf[kBlock];
    auto* h = static_cast<std::uint16_t*>(out);
    std::size_t read = 0;
    for (std::size_t b = 0; b < count; b += kBlock) {
      const std::size_t len = std::min(kBlock, count - b);
      read += scatter_f32<V, false>(in + read, mask + b / 64, len, buf);
      if (out_dtype == DType::kFloat16) {
        for (std::size_t i = 0; i < len; ++i) h[b + i] = float_to_half(buf[i]);
      } else {
        for (std::size_t i = 0; i < len; ++i) h[b + i] = float_to_bf16(buf[i]);
      }
    }
    return read;
  });
}

std::size_t nm_scatter_add(const void* values, DType value_dtype, const std::uint64_t* mask,
                           std::size_t count, float* out) {
  return with_value_codec(value_dtype, [&](auto codec) {
    using V = decltype(codec);
    return scatter_f32<V, true>(static_cast<const typename V::T*>(values), mask, count, out);
  });
}

void nm_select_by_wait(const float* estimate, const float* wait, std::size_t count, int n, int m,
                       std::uint64_t* mask) {
  nm_check(n, m);
  // Scores a block at a time (whole mask words and groups), never a full-size temporary.
  constexpr std::size_t kTarget = 4096;
  const std::size_t unit = 64 * static_cast<std::size_t>(m);
  const std::size_t block = unit * std::max<std::size_t>(1, kTarget / unit);
  float score[kTarget];
  for (std::size_t b = 0; b < count; b += block) {
    const std::size_t len = std::min(block, count - b);
    for (std::size_t i = 0; i < len; ++i) {
      score[i] = std::fabs(estimate[b + i]) * (wait[b + i] + 1.0f);
    }
    select_mask_f32(score, len, n, m, mask + b / 64);
  }
}

void nm_track(float* estimate, float* wait, const float* reduced, const std::uint64_t* mask,
              std::size_t count) {
  std::size_t i = 0;
#if FR_NM_X86
  if (use_level() >= 1) i = track_avx2(estimate, wait, reduced, mask, count);
#endif
  for (; i < count; ++i) {
    const bool sent = bit_at(mask, i);
    const float w = wait[i];
    estimate[i] = sent ? reduced[i] / (w + 1.0f) : estimate[i];
    wait[i] = sent ? 0.0f : w + 1.0f;
  }
}

int nm_vector_level_available() { return cpu_vector_level(); }

int nm_set_vector_level(int level) {
  const int chosen = std::max(0, std::min(level, nm_vector_level_available()));
  vector_level().store(chosen);
  return chosen;
}

}  // namespace fusionring
