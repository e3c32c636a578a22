#include "cluster_quant.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_features.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FR_CQ_X86 1
#include <immintrin.h>
// Compiled for AVX2 only and chosen at run time, so the module loads on any x86-64 CPU.
#define FR_AVX2 __attribute__((target("avx2,fma")))
#define FR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#else
#define FR_CQ_X86 0
#endif

namespace fusionring {
namespace {

std::atomic<int> g_level{-1};

// 0: portable loops, 1: AVX2, 2: AVX-512 for the encoder's id search and table adds.
int available_level() { return cpu::vector_level(); }

int use_level() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    level = available_level();
    g_level.store(level, std::memory_order_relaxed);
  }
  return level;
}

inline std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr std::uint32_t kGolden = 0x9E3779B1u;

// Bucket of value i within a cluster of `nb` buckets: a multiplicative hash of the index,
// scaled to [0, nb) with 16-bit factors so the vector path needs only 32-bit products.
inline std::uint32_t slot_of(std::size_t i, std::uint32_t nb) {
  const std::uint32_t h = static_cast<std::uint32_t>(i) * kGolden;
  return ((h >> 16) * nb) >> 16;
}

struct Layout {
  int bits;
  std::size_t vsize, nb_offset, ids_offset, total;
};

Layout layout_of(const ClusterConfig& c, std::size_t count) {
  Layout l;
  l.bits = cluster_id_bits(c.k);
  l.vsize = element_size(c.values);
  l.nb_offset = c.buckets * l.vsize;
  l.ids_offset = l.nb_offset + 2 * static_cast<std::size_t>(c.k);
  const std::size_t ids = (count * static_cast<std::size_t>(l.bits) + 7) / 8;
  l.total = count == 0 ? 0 : (l.ids_offset + ids + 7) / 8 * 8;
  return l;
}

// What one block learnt: centres, boundaries and the buckets of each cluster.
struct Model {
  int k = 0;
  float centres[kClusterMaxK];
  float bounds[kClusterMaxK];     // k - 1 used
  std::uint32_t nb[kClusterMaxK];   // buckets per cluster
  std::uint32_t off[kClusterMaxK];  // first bucket of each cluster
};

void set_bounds(Model& m) {
  for (int j = 0; j + 1 < m.k; ++j) m.bounds[j] = (m.centres[j] + m.centres[j + 1]) * 0.5f;
}

// Run of the sorted sample in cluster j: boundary_{j-1} < x <= boundary_j.
inline void run_of(const Model& m, const std::vector<float>& s, int j, std::size_t& lo,
                   std::size_t& hi) {
  lo = j == 0 ? 0
              : static_cast<std::size_t>(
                    std::upper_bound(s.begin(), s.end(), m.bounds[j - 1]) - s.begin());
  hi = j == m.k - 1 ? s.size()
                    : static_cast<std::size_t>(
                          std::upper_bound(s.begin(), s.end(), m.bounds[j]) - s.begin());
  if (hi < lo) hi = lo;
}

void fit(const float* x, std::size_t count, const ClusterConfig& c, std::uint64_t stream,
         Model& m) {
  const int K = c.k;
  m.k = K;
  std::vector<float> s;
  s.reserve(std::min(count, c.sample));
  if (count <= c.sample) {
    for (std::size_t i = 0; i < count; ++i) {
      if (std::isfinite(x[i])) s.push_back(x[i]);
    }
  } else {
    std::uint64_t state = stream;
    for (std::size_t n = 0; n < c.sample; ++n) {
      const std::uint64_t r = splitmix64(state);
      const auto i = static_cast<std::size_t>(
          (static_cast<unsigned __int128>(r) * static_cast<unsigned __int128>(count)) >> 64);
      if (std::isfinite(x[i])) s.push_back(x[i]);
    }
  }
  std::sort(s.begin(), s.end());
  const std::size_t S = s.size();
  std::vector<double> prefix(S + 1, 0.0);
  for (std::size_t i = 0; i < S; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(s[i]);

  for (int j = 0; j < K; ++j) {
    m.centres[j] = S ? s[(static_cast<std::size_t>(2 * j + 1) * S) / (2 * static_cast<std::size_t>(K))]
                     : 0.0f;
  }
  std::size_t lo, hi;
  for (int step = 0; step < kClusterLloydSteps && S; ++step) {
    set_bounds(m);
    bool moved = false;
    float next[kClusterMaxK];
    for (int j = 0; j < K; ++j) {
      run_of(m, s, j, lo, hi);
      next[j] = hi > lo ? static_cast<float>((prefix[hi] - prefix[lo]) / static_cast<double>(hi - lo))
                        : m.centres[j];
      moved |= next[j] != m.centres[j];
    }
    std::copy(next, next + K, m.centres);
    if (!moved) break;
  }
  set_bounds(m);

  // Scores: density x |centre| x entropy, each normalised by its maximum.
  double density[kClusterMaxK], value[kClusterMaxK], entropy[kClusterMaxK];
  for (int j = 0; j < K; ++j) {
    run_of(m, s, j, lo, hi);
    const std::size_t n = hi - lo;
    density[j] = S ? static_cast<double>(n) / static_cast<double>(S) : 0.0;
    value[j] = std::fabs(static_cast<double>(m.centres[j]));
    entropy[j] = 0.0;
    if (n > 1 && s[hi - 1] != s[lo]) {
      const double first = s[lo], width = static_cast<double>(s[hi - 1]) - first;
      std::size_t bins[kClusterEntropyBins] = {};
      for (std::size_t i = lo; i < hi; ++i) {
        auto b = static_cast<int>((static_cast<double>(s[i]) - first) / width * kClusterEntropyBins);
        bins[std::min(b, kClusterEntropyBins - 1)]++;
      }
      for (int b = 0; b < kClusterEntropyBins; ++b) {
        if (bins[b] == 0) continue;
        const double q = static_cast<double>(bins[b]) / static_cast<double>(n);
        entropy[j] -= q * std::log2(q);
      }
    }
  }
  for (double* f : {density, value, entropy}) {
    double top = 0.0;
    for (int j = 0; j < K; ++j) top = std::max(top, f[j]);
    for (int j = 0; j < K; ++j) f[j] = top > 0.0 ? f[j] / top : 1.0;
  }
  double score[kClusterMaxK], total = 0.0;
  for (int j = 0; j < K; ++j) {
    score[j] = density[j] * value[j] * entropy[j];
    total += score[j];
  }

  // Buckets: one each, the rest in proportion to the scores by largest remainders.
  const std::size_t extra = c.buckets - static_cast<std::size_t>(K);
  std::size_t given = 0;
  double frac[kClusterMaxK];
  for (int j = 0; j < K; ++j) {
    std::size_t share;
    if (total > 0.0) {
      const double exact = static_cast<double>(extra) * score[j] / total;
      share = static_cast<std::size_t>(std::floor(exact));
      frac[j] = exact - static_cast<double>(share);
    } else {
      share = extra / static_cast<std::size_t>(K);
      frac[j] = static_cast<std::size_t>(j) < extra % static_cast<std::size_t>(K) ? 1.0 : 0.0;
    }
    m.nb[j] = static_cast<std::uint32_t>(1 + share);
    given += share;
  }
  int order[kClusterMaxK];
  for (int j = 0; j < K; ++j) order[j] = j;
  std::stable_sort(order, order + K, [&](int a, int b) { return frac[a] > frac[b]; });
  for (std::size_t r = 0; given + r < extra; ++r) m.nb[order[r % static_cast<std::size_t>(K)]]++;
  std::uint32_t at = 0;
  for (int j = 0; j < K; ++j) {
    m.off[j] = at;
    at += m.nb[j];
  }
}

// Sum and count of one bucket in one lane. Value i accumulates into lane i % 16, in element
// order, and the lanes are added in order 0..15: the portable and vector paths add the same
// numbers in the same order, so they give the same bits. Sixteen lanes because most values
// fall in a few busy buckets: a lane's next add to the same bucket comes two vector steps
// later, after its previous store has landed, instead of waiting on it.
struct Acc {
  double sum, count;
};
static_assert(sizeof(Acc) == 16, "the AVX-512 insert adds (sum, count) as one 16-byte pair");
constexpr int kLanes = 16;

inline int id_scalar(const Model& m, float x) {
  return static_cast<int>(std::lower_bound(m.bounds, m.bounds + m.k - 1, x) - m.bounds);
}

inline void put_id(std::uint8_t* ids, std::size_t i, int bits, std::uint32_t id) {
  const std::size_t pos = i * static_cast<std::size_t>(bits);
  const std::size_t byte = pos >> 3;
  const unsigned shift = pos & 7;
  ids[byte] |= static_cast<std::uint8_t>(id << shift);
  if (shift + static_cast<unsigned>(bits) > 8) ids[byte + 1] |= static_cast<std::uint8_t>(id >> (8 - shift));
}

inline std::uint32_t get_id(const std::uint8_t* ids, std::size_t i, int bits) {
  const std::size_t pos = i * static_cast<std::size_t>(bits);
  const std::size_t byte = pos >> 3;
  const unsigned shift = pos & 7;
  std::uint32_t v = ids[byte] >> shift;
  if (shift + static_cast<unsigned>(bits) > 8) v |= static_cast<std::uint32_t>(ids[byte + 1]) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

void insert_scalar(const float* x, std::size_t begin, std::size_t count, const Model& m, int bits,
                   std::uint8_t* ids, Acc* acc, std::size_t B) {
  for (std::size_t i = begin; i < count; ++i) {
    const int id = id_scalar(m, x[i]);
    const std::uint32_t b = m.off[id] + slot_of(i, m.nb[id]);
    Acc& a = acc[(i % kLanes) * B + b];
    a.sum += static_cast<double>(x[i]);
    a.count += 1.0;
    put_id(ids, i, bits, static_cast<std::uint32_t>(id));
  }
}

// The residual of x when v is sent for it. One value that is not finite, or beyond the range
// of the values' dtype (`limit`, its largest finite value), makes its bucket's mean, and so
// v, not finite for every value in the bucket: those values keep all of x (the step carries
// the inf or NaN, which a loss scaler sees and skips, and nothing that can be sent is lost),
// except the values that caused it, which would spoil every later step. A residual that is
// still not finite (x itself, or x - v beyond float) is kept as 0, as N:M's.
inline float residual_of(float x, float v, float limit) {
  const float r = x - v;
  if (std::isfinite(r)) return r;
  return !std::isfinite(v) && std::fabs(x) <= limit ? x : 0.0f;
}

// The largest finite value of a cluster payload's values.
float values_limit(DType values) {
  if (values == DType::kFloat16) return 65504.0f;
  if (values == DType::kBFloat16) return bf16_to_float(0x7f7f);
  return std::numeric_limits<float>::max();
}

// mode 0: out = v; 1: out += v; 2: out = x - v (the residual of x, by residual_of).
template <int Mode>
void decode_scalar(const std::uint8_t* ids, std::size_t begin, std::size_t count, int bits,
                   const std::uint32_t* nb, const std::uint32_t* off, const float* means,
                   const float* x, float* out, float limit) {
  for (std::size_t i = begin; i < count; ++i) {
    const std::uint32_t id = get_id(ids, i, bits);
    const float v = means[off[id] + slot_of(i, nb[id])];
    if (Mode == 0) out[i] = v;
    if (Mode == 1) out[i] += v;
    if (Mode == 2) out[i] = residual_of(x[i], v, limit);
  }
}

#if FR_CQ_X86
// Each cluster's first bucket and bucket count in one 32-bit word (off << 16 | nb; both
// fit 16 bits as B <= 65535), so one table lookup per lane serves both. k <= 16: two
// registers, picked by id > 7.
struct PackedTable {
  __m256i lo, hi;
};

FR_AVX2 inline PackedTable packed_table(const std::uint32_t* nb, const std::uint32_t* off, int k) {
  alignas(32) std::uint32_t t[16] = {};
  for (int j = 0; j < k; ++j) t[j] = (off[j] << 16) | nb[j];
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(t)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(t + 8))};
}

// Buckets of 8 values with cluster ids `id` at indices `index`.
template <int BITS>
FR_AVX2 inline __m256i buckets8(const PackedTable& table, __m256i id, __m256i index) {
  __m256i entry = _mm256_permutevar8x32_epi32(table.lo, id);
  if (BITS == 4) {
    entry = _mm256_blendv_epi8(entry, _mm256_permutevar8x32_epi32(table.hi, id),
                               _mm256_cmpgt_epi32(id, _mm256_set1_epi32(7)));
  }
  const __m256i h = _mm256_srli_epi32(
      _mm256_mullo_epi32(index, _mm256_set1_epi32(static_cast<int>(kGolden))), 16);
  const __m256i nb = _mm256_and_si256(entry, _mm256_set1_epi32(0xFFFF));
  return _mm256_add_epi32(_mm256_srli_epi32(entry, 16),
                          _mm256_srli_epi32(_mm256_mullo_epi32(h, nb), 16));
}

// Cluster ids of 8 values: a branchless binary search over the boundaries padded with +inf
// to 2^BITS - 1 (so #{boundary < x}, as the portable loop counts). Level L tests one of 2^L
// candidate boundaries per lane; up to 4 candidates are picked by an in-lane permute (cheap
// everywhere), 8 by two of them and a blend.
template <int BITS>
struct IdSearch {
  __m256 level[BITS + 1];  // candidates of each level, replicated in both 128-bit halves
  FR_AVX2 explicit IdSearch(const Model& m) {
    float b[16];
    for (int j = 0; j < 15; ++j) b[j] = j < m.k - 1 ? m.bounds[j] : INFINITY;
    int slot = 0;
    for (int L = 0; L < BITS; ++L) {
      const int step = 1 << (BITS - 1 - L);
      float c[8] = {};
      for (int n = 0; n < (1 << L); ++n) c[n] = b[n * 2 * step + step - 1];
      if (L < 3) {
        level[slot++] = _mm256_setr_ps(c[0], c[1], c[2], c[3], c[0], c[1], c[2], c[3]);
      } else {
        level[slot++] = _mm256_setr_ps(c[0], c[1], c[2], c[3], c[0], c[1], c[2], c[3]);
        level[slot++] = _mm256_setr_ps(c[4], c[5], c[6], c[7], c[4], c[5], c[6], c[7]);
      }
    }
  }
  FR_AVX2 __m256i operator()(__m256 v) const {
    __m256i id = _mm256_setzero_si256();
    int slot = 0;
    for (int L = 0; L < BITS; ++L) {
      const int step = 1 << (BITS - 1 - L);
      const __m256i which = _mm256_srli_epi32(id, BITS - L);  // candidate number 0..2^L-1
      __m256 c = _mm256_permutevar_ps(level[slot++], which);
      if (L == 3) {
        c = _mm256_blendv_ps(c, _mm256_permutevar_ps(level[slot++], which),
                             _mm256_castsi256_ps(_mm256_slli_epi32(id, 28)));
      }
      const __m256i hit = _mm256_castps_si256(_mm256_cmp_ps(c, v, _CMP_LT_OQ));
      id = _mm256_or_si256(id, _mm256_and_si256(hit, _mm256_set1_epi32(step)));
    }
    return id;
  }
};

// The 8 ids of `id` as 8 * BITS packed bits (BITS bytes): lane l shifted by l * BITS and
// OR-ed together (the bits are disjoint).
template <int BITS>
FR_AVX2 inline void pack8(__m256i id, std::uint8_t* out) {
  const __m256i packed = _mm256_sllv_epi32(
      id, _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS));
  __m128i w = _mm_or_si128(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
  w = _mm_or_si128(w, _mm_shuffle_epi32(w, 0x4E));
  w = _mm_or_si128(w, _mm_shuffle_epi32(w, 0xB1));
  const std::uint32_t word = static_cast<std::uint32_t>(_mm_cvtsi128_si32(w));
  std::memcpy(out, &word, BITS);
}

// k <= 16 (ids of BITS <= 4 bits): 8 values a step; 8 ids fill exactly BITS bytes. With one
// bucket per cluster (ONE) a value's bucket is its cluster id: no hash to compute.
// The ids and buckets are computed in vector registers; the sums are added one lane at a time
// (a scatter into a small table).
template <int BITS, bool ONE>
FR_AVX2 std::size_t insert_avx2(const float* x, std::size_t count, const Model& m,
                                std::uint8_t* ids, Acc* acc, std::size_t B) {
  constexpr int bits = BITS;
  const PackedTable table = packed_table(m.nb, m.off, m.k);
  const IdSearch<BITS> search(m);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  std::size_t i = 0;
  // The ids are searched two steps ahead of the adds that need them for their addresses: the
  // search is a long dependency chain, and with one step between them the chains of
  // consecutive steps did not overlap enough (two steps: 0.29x -> 0.33x memcpy on Zen 5).
  __m256i next = count >= 8 ? search(_mm256_loadu_ps(x)) : _mm256_setzero_si256();
  __m256i after = count >= 16 ? search(_mm256_loadu_ps(x + 8)) : _mm256_setzero_si256();
  for (; i + 8 <= count; i += 8) {
    const __m256i id = next;
    next = after;
    if (i + 24 <= count) after = search(_mm256_loadu_ps(x + i + 16));
    const __m256i b = ONE ? id : buckets8<BITS>(table, id, index);
    index = _mm256_add_epi32(index, eight);
    // Lane by lane: the bucket from the register, the value from the input (both without a
    // round trip through memory just written).
    Acc* lanes = acc + (i & 8) * B;
    const __m128i b_lo = _mm256_castsi256_si128(b), b_hi = _mm256_extracti128_si256(b, 1);
    const std::uint32_t bs[8] = {
        static_cast<std::uint32_t>(_mm_cvtsi128_si32(b_lo)),
        static_cast<std::uint32_t>(_mm_extract_epi32(b_lo, 1)),
        static_cast<std::uint32_t>(_mm_extract_epi32(b_lo, 2)),
        static_cast<std::uint32_t>(_mm_extract_epi32(b_lo, 3)),
        static_cast<std::uint32_t>(_mm_cvtsi128_si32(b_hi)),
        static_cast<std::uint32_t>(_mm_extract_epi32(b_hi, 1)),
        static_cast<std::uint32_t>(_mm_extract_epi32(b_hi, 2)),
        static_cast<std::uint32_t>(_mm_extract_epi32(b_hi, 3))};
    for (int lane = 0; lane < 8; ++lane) {
      Acc& a = lanes[static_cast<std::size_t>(lane) * B + bs[lane]];
      a.sum += static_cast<double>(x[i + static_cast<std::size_t>(lane)]);
      a.count += 1.0;
    }
    pack8<BITS>(id, ids + (i / 8) * bits);
  }
  return i;
}

// Cluster ids of 16 values: the same binary search with all 15 boundaries (padded with +inf)
// in one register, so each level is one permute of the candidate `id | (step - 1)` (the
// bits below `step` are still clear), a compare into a mask, and a masked OR.
template <int BITS>
struct IdSearch16 {
  __m512 bounds;
  FR_AVX512 explicit IdSearch16(const Model& m) {
    alignas(64) float b[16];
    for (int j = 0; j < 16; ++j) b[j] = j < m.k - 1 ? m.bounds[j] : INFINITY;
    bounds = _mm512_load_ps(b);
  }
  FR_AVX512 __m512i operator()(__m512 v) const {
    __m512i id = _mm512_setzero_si512();
    for (int L = 0; L < BITS; ++L) {
      const int step = 1 << (BITS - 1 - L);
      const __m512 c =
          _mm512_permutexvar_ps(_mm512_or_si512(id, _mm512_set1_epi32(step - 1)), bounds);
      const __mmask16 hit = _mm512_cmp_ps_mask(c, v, _CMP_LT_OQ);
      id = _mm512_mask_or_epi32(id, hit, id, _mm512_set1_epi32(step));
    }
    return id;
  }
};

// insert_avx2 with 16 values a step: value i + l goes to lane l, as i is a multiple of 16, so the
// lanes see the same values in the same order and the sums have the same bits. Each lane's
// (sum, count) pair is updated by one 16-byte add of {value, 1}; the pairs are built for
// all 16 values at once and the entries' byte offsets computed in a vector.
template <int BITS, bool ONE>
FR_AVX512 std::size_t insert_avx512(const float* x, std::size_t count, const Model& m,
                                    std::uint8_t* ids, Acc* acc, std::size_t B) {
  const PackedTable table = packed_table(m.nb, m.off, m.k);
  const IdSearch16<BITS> search(m);
  const __m512i lane_offset =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(B * sizeof(Acc))));
  const __m512d ones = _mm512_set1_pd(1.0);
  __m256i index_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i index_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i sixteen = _mm256_set1_epi32(16);
  char* base = reinterpret_cast<char*>(acc);
  alignas(64) std::uint32_t at[16];
  std::size_t i = 0;
  // As in insert_avx2, the ids are searched ahead of the adds, here three steps (one: 0.32x
  // memcpy on Zen 5, two: 0.38x, three: 0.40x).
  __m512i next = count >= 16 ? search(_mm512_loadu_ps(x)) : _mm512_setzero_si512();
  __m512i after = count >= 32 ? search(_mm512_loadu_ps(x + 16)) : _mm512_setzero_si512();
  __m512i third = count >= 48 ? search(_mm512_loadu_ps(x + 32)) : _mm512_setzero_si512();
  for (; i + 16 <= count; i += 16) {
    const __m512i id = next;
    next = after;
    after = third;
    if (i + 64 <= count) third = search(_mm512_loadu_ps(x + i + 48));
    const __m256i id_lo = _mm512_castsi512_si256(id), id_hi = _mm512_extracti64x4_epi64(id, 1);
    __m512i b = id;
    if (!ONE) {
      b = _mm512_inserti64x4(_mm512_castsi256_si512(buckets8<BITS>(table, id_lo, index_lo)),
                             buckets8<BITS>(table, id_hi, index_hi), 1);
      index_lo = _mm256_add_epi32(index_lo, sixteen);
      index_hi = _mm256_add_epi32(index_hi, sixteen);
    }
    _mm512_store_si512(at, _mm512_add_epi32(_mm512_slli_epi32(b, 4), lane_offset));
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512d d_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d d_hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
    // unpacklo gives the pairs of values 0, 2, 4, 6 (of each group of 8), unpackhi 1, 3, 5, 7.
    const __m512d pairs[4] = {_mm512_unpacklo_pd(d_lo, ones), _mm512_unpackhi_pd(d_lo, ones),
                              _mm512_unpacklo_pd(d_hi, ones), _mm512_unpackhi_pd(d_hi, ones)};
    auto add = [&](int lane, __m128d pair) {
      double* e = reinterpret_cast<double*>(base + at[lane]);
      _mm_storeu_pd(e, _mm_add_pd(_mm_loadu_pd(e), pair));
    };
    for (int g = 0; g < 2; ++g) {
      const __m512d& even = pairs[2 * g];
      const __m512d& odd = pairs[2 * g + 1];
      add(8 * g + 0, _mm512_castpd512_pd128(even));
      add(8 * g + 1, _mm512_castpd512_pd128(odd));
      add(8 * g + 2, _mm512_extractf64x2_pd(even, 1));
      add(8 * g + 3, _mm512_extractf64x2_pd(odd, 1));
      add(8 * g + 4, _mm512_extractf64x2_pd(even, 2));
      add(8 * g + 5, _mm512_extractf64x2_pd(odd, 2));
      add(8 * g + 6, _mm512_extractf64x2_pd(even, 3));
      add(8 * g + 7, _mm512_extractf64x2_pd(odd, 3));
    }
    pack8<BITS>(id_lo, ids + (i / 8) * BITS);
    pack8<BITS>(id_hi, ids + (i / 8 + 1) * BITS);
  }
  return i;
}

// The buckets are computed in vector registers; the means are read one lane at a time (a
// table lookup, cheaper than a gather on the CPUs this runs on). With one bucket per cluster
// (ONE) the means sit in two registers and a permute reads them.
// All ones in the lanes of `a` that are finite.
FR_AVX2 inline __m256 finite8(__m256 a) {
  const __m256 magnitude = _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_cmp_ps(magnitude, _mm256_set1_ps(HUGE_VALF), _CMP_LT_OQ);
}

template <int Mode, int BITS, bool ONE>
FR_AVX2 std::size_t decode_avx2(const std::uint8_t* ids, std::size_t count,
                                const std::uint32_t* nb, const std::uint32_t* off, int k,
                                const float* means, const float* x, float* out, float limit) {
  constexpr int bits = BITS;
  const PackedTable table = packed_table(nb, off, k);
  const __m256i shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits,
                                           6 * bits, 7 * bits);
  const __m256i idmask = _mm256_set1_epi32((1 << bits) - 1);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  alignas(32) std::uint32_t b[8];
  alignas(32) float centre[16] = {};
  if (ONE) std::copy(means, means + k, centre);
  const __m256 centre_lo = _mm256_load_ps(centre), centre_hi = _mm256_load_ps(centre + 8);
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    std::uint32_t word = 0;
    std::memcpy(&word, ids + (i / 8) * bits, bits);
    const __m256i id = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), idmask);
    __m256 v;
    if (ONE) {
      v = _mm256_permutevar8x32_ps(centre_lo, id);
      if (BITS == 4) {
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(centre_hi, id),
                             _mm256_castsi256_ps(_mm256_slli_epi32(id, 28)));
      }
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(b), buckets8<BITS>(table, id, index));
      index = _mm256_add_epi32(index, eight);
      v = _mm256_setr_ps(means[b[0]], means[b[1]], means[b[2]], means[b[3]], means[b[4]],
                         means[b[5]], means[b[6]], means[b[7]]);
    }
    if (Mode == 0) _mm256_storeu_ps(out + i, v);
    if (Mode == 1) _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), v));
    if (Mode == 2) {  // residual_of, 8 at a time
      const __m256 xv = _mm256_loadu_ps(x + i);
      const __m256 r = _mm256_sub_ps(xv, v);
      const __m256 magnitude =
          _mm256_and_ps(xv, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
      const __m256 keep_x = _mm256_andnot_ps(
          finite8(v), _mm256_cmp_ps(magnitude, _mm256_set1_ps(limit), _CMP_LE_OQ));
      _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_and_ps(r, finite8(r)), xv, keep_x));
    }
  }
  return i;
}
#endif

// The bucket means of a payload as float32, and each cluster's buckets and first bucket.
struct Tables {
  std::vector<float> means;
  std::uint32_t nb[kClusterMaxK], off[kClusterMaxK];
};

Tables read_tables(const void* payload, const ClusterConfig& c, const Layout& l) {
  Tables t;
  t.means.resize(c.buckets);
  const auto* p = static_cast<const std::uint8_t*>(payload);
  for (std::size_t b = 0; b < c.buckets; ++b) {
    if (c.values == DType::kFloat32) {
      std::memcpy(&t.means[b], p + 4 * b, 4);
    } else {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * b, 2);
      t.means[b] = c.values == DType::kFloat16 ? half_to_float(h) : bf16_to_float(h);
    }
  }
  std::uint32_t at = 0;
  for (int j = 0; j < c.k; ++j) {
    std::uint16_t n;
    std::memcpy(&n, p + l.nb_offset + 2 * static_cast<std::size_t>(j), 2);
    t.nb[j] = n;
    t.off[j] = at;
    at += n;
  }
  if (at != c.buckets) throw InvalidArgument("cluster payload: bucket counts do not add up to buckets");
  return t;
}

template <int Mode>
void decode_block(const void* payload, std::size_t count, const ClusterConfig& c, const float* x,
                  float* out) {
  const Layout l = layout_of(c, count);
  const Tables t = read_tables(payload, c, l);
  const auto* ids = static_cast<const std::uint8_t*>(payload) + l.ids_offset;
  const float limit = values_limit(c.values);
  std::size_t i = 0;
#if FR_CQ_X86
  if (use_level() >= 1) {
    const float* means = t.means.data();
    const bool one = c.buckets == static_cast<std::size_t>(c.k);
#define FR_CQ_DECODE(B, O) \
  decode_avx2<Mode, B, O>(ids, count, t.nb, t.off, c.k, means, x, out, limit)
    switch (l.bits) {
      case 1: i = one ? FR_CQ_DECODE(1, true) : FR_CQ_DECODE(1, false); break;
      case 2: i = one ? FR_CQ_DECODE(2, true) : FR_CQ_DECODE(2, false); break;
      case 3: i = one ? FR_CQ_DECODE(3, true) : FR_CQ_DECODE(3, false); break;
      case 4: i = one ? FR_CQ_DECODE(4, true) : FR_CQ_DECODE(4, false); break;
      default: break;  // k > 16: the portable loop
    }
#undef FR_CQ_DECODE
  }
#endif
  decode_scalar<Mode>(ids, i, count, l.bits, t.nb, t.off, t.means.data(), x, out, limit);
}

}  // namespace

void cluster_check(const ClusterConfig& c) {
  if (c.k < 2 || c.k > kClusterMaxK) {
    throw InvalidArgument("cluster k=" + std::to_string(c.k) + " must be in [2, " +
                          std::to_string(kClusterMaxK) + "]");
  }
  if (c.sample < 1) throw InvalidArgument("cluster sample must be >= 1");
  if (c.buckets < static_cast<std::size_t>(c.k) || c.buckets > kClusterMaxBuckets) {
    throw InvalidArgument("cluster buckets=" + std::to_string(c.buckets) + " must be in [k=" +
                          std::to_string(c.k) + ", " + std::to_string(kClusterMaxBuckets) + "]");
  }
  if (c.values != DType::kFloat32 && c.values != DType::kFloat16 && c.values != DType::kBFloat16) {
    throw InvalidArgument(std::string("cluster values dtype ") + dtype_name(c.values) +
                          " must be float32, float16 or bfloat16");
  }
}

int cluster_id_bits(int k) {
  int bits = 0;
  while ((1 << bits) < k) ++bits;
  return bits;
}

std::size_t cluster_payload_bytes(const ClusterConfig& c, std::size_t count) {
  return layout_of(c, count).total;
}

std::uint64_t cluster_stream(std::uint64_t seed, std::uint64_t step, std::uint64_t at) {
  std::uint64_t s = seed;
  s = splitmix64(s) ^ step;
  s = splitmix64(s) ^ at;
  return splitmix64(s);
}

int cluster_set_vector_level(int level) {
  const int chosen = std::max(0, std::min(level, available_level()));
  g_level.store(chosen, std::memory_order_relaxed);
  return chosen;
}

void cluster_encode(const float* x, std::size_t count, const ClusterConfig& c, std::uint64_t stream,
                    void* payload, float* residual, ClusterEncodeInfo* info) {
  cluster_check(c);
  if (count == 0) return;
  const Layout l = layout_of(c, count);
  Model m;
  fit(x, count, c, stream, m);
  if (info) std::copy(m.centres, m.centres + c.k, info->centres);

  auto* p = static_cast<std::uint8_t*>(payload);
  std::uint8_t* ids = p + l.ids_offset;
  std::memset(p + l.nb_offset, 0, l.ids_offset - l.nb_offset);
  const std::size_t B = c.buckets;
  std::vector<Acc> acc(static_cast<std::size_t>(kLanes) * B, Acc{0.0, 0.0});
  std::size_t i = 0;
#if FR_CQ_X86
  const int level = use_level();
  if (level >= 1) {
    const bool one = B == static_cast<std::size_t>(c.k);
#define FR_CQ_INSERT(BITS, O)                                        \
  (level >= 2 ? insert_avx512<BITS, O>(x, count, m, ids, acc.data(), B) \
              : insert_avx2<BITS, O>(x, count, m, ids, acc.data(), B))
    switch (l.bits) {
      case 1: i = one ? FR_CQ_INSERT(1, true) : FR_CQ_INSERT(1, false); break;
      case 2: i = one ? FR_CQ_INSERT(2, true) : FR_CQ_INSERT(2, false); break;
      case 3: i = one ? FR_CQ_INSERT(3, true) : FR_CQ_INSERT(3, false); break;
      case 4: i = one ? FR_CQ_INSERT(4, true) : FR_CQ_INSERT(4, false); break;
      default: break;  // k > 16: the portable loop
    }
#undef FR_CQ_INSERT
  }
#endif
  // The vector loops wrote whole bytes of ids (i is a multiple of 8); the portable loop ORs
  // its ids into zeroed bytes, and the padding is zero.
  const std::size_t written = i / 8 * static_cast<std::size_t>(l.bits);
  std::memset(ids + written, 0, l.total - l.ids_offset - written);
  insert_scalar(x, i, count, m, l.bits, ids, acc.data(), B);

  for (std::size_t b = 0; b < B; ++b) {
    double sum = 0.0, n = 0.0;
    for (int lane = 0; lane < kLanes; ++lane) {
      sum += acc[static_cast<std::size_t>(lane) * B + b].sum;
      n += acc[static_cast<std::size_t>(lane) * B + b].count;
    }
    const float mean = n > 0.0 ? static_cast<float>(sum / n) : 0.0f;
    if (c.values == DType::kFloat32) {
      std::memcpy(p + 4 * b, &mean, 4);
    } else {
      const std::uint16_t h = c.values == DType::kFloat16 ? float_to_half(mean) : float_to_bf16(mean);
      std::memcpy(p + 2 * b, &h, 2);
    }
  }
  for (int j = 0; j < c.k; ++j) {
    const auto n = static_cast<std::uint16_t>(m.nb[j]);
    std::memcpy(p + l.nb_offset + 2 * static_cast<std::size_t>(j), &n, 2);
  }
  if (residual) decode_block<2>(payload, count, c, x, residual);
}

void cluster_decode(const void* payload, std::size_t count, const ClusterConfig& c, float* out,
                    bool add) {
  cluster_check(c);
  if (count == 0) return;
  if (add) {
    decode_block<1>(payload, count, c, nullptr, out);
  } else {
    decode_block<0>(payload, count, c, nullptr, out);
  }
}

}  // namespace fusionring
