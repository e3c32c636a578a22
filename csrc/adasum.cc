#include "adasum.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reduce.h"

namespace fusionring {
namespace {

struct Segment {
  std::size_t lo, hi;
};

// Sums `values` over the 2^(levels) ranks that share this rank's higher bits. Each step
// adds two operands that both partners hold, and addition commutes, so every member ends
// with bitwise the same sums.
void group_sum(double* values, int n, int levels, Transport& t) {
  std::vector<double> theirs(n);
  for (int k = 0; k < levels; ++k) {
    const int partner = t.rank() ^ (1 << k);
    t.sendrecv(values, n * sizeof(double), partner, theirs.data(), n * sizeof(double), partner);
    for (int i = 0; i < n; ++i) values[i] += theirs[i];
  }
  t.wait_all();  // every request has completed; this empties the transport's table
}

// 1 - a.b / 2|a|^2, or 1 when a is zero. No threshold on the norm: the combination is
// scale-free (parallel vectors average, orthogonal ones add, however small they are), and
// optimizer deltas and small layers' gradients often have squared norms far below 1e-8.
double coefficient(double dot, double normsq) {
  if (!(normsq > 0.0)) return 1.0;
  const double c = 1.0 - dot / (2.0 * normsq);
  return std::isfinite(c) ? c : 1.0;  // |b|/|a| beyond double's range: a adds nothing
}

// a.b, |a|^2 and |b|^2 added to sums[0..2], in double. Eight partial sums per quantity
// instead of one: a single running sum is a chain of dependent additions, several times
// slower than reading the operands; eight independent ones run at memory speed (and form
// vectors). The lanes are added in a fixed order, so a piece always gives the same sums.
template <typename T>
inline void lane_dots_impl(const T* a, const T* b, std::size_t n, double sums[3]) {
  constexpr std::size_t kLanes = 8;
  double ab[kLanes] = {}, aa[kLanes] = {}, bb[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (std::size_t j = 0; j < kLanes; ++j) {
      const double x = a[i + j], y = b[i + j];
      ab[j] += x * y;
      aa[j] += x * x;
      bb[j] += y * y;
    }
  }
  for (std::size_t j = 0; i < n; ++i, ++j) {
    const double x = a[i], y = b[i];
    ab[j] += x * y;
    aa[j] += x * x;
    bb[j] += y * y;
  }
  for (std::size_t j = 0; j < kLanes; ++j) {
    sums[0] += ab[j];
    sums[1] += aa[j];
    sums[2] += bb[j];
  }
}

// Compiled twice, for AVX2 + FMA and for the baseline; the loader picks one for the CPU.
#if defined(__x86_64__) && defined(__GNUC__)
#define FR_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define FR_CLONES
#endif

FR_CLONES void lane_dots(const float* a, const float* b, std::size_t n, double sums[3]) {
  lane_dots_impl(a, b, n, sums);
}

FR_CLONES void lane_dots(const double* a, const double* b, std::size_t n, double sums[3]) {
  lane_dots_impl(a, b, n, sums);
}

// One level's arithmetic on the stored type: the dot products a.b, |a|^2, |b|^2 of this
// rank's piece (accumulated in double), and the combination written over the piece.
template <typename T>
struct NativeKernel {
  using Stored = T;

  void dots(const T* a, const T* b, std::size_t n, double sums[3]) const {
    lane_dots(a, b, n, sums);
  }

  void combine(T* out, const T* a, const T* b, std::size_t n, double ac, double bc) const {
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = static_cast<T>(ac * static_cast<double>(a[i]) + bc * static_cast<double>(b[i]));
    }
  }
};

// 16-bit floats travel as they are, so the tree moves half the bytes of float32. The
// arithmetic widens a block at a time to float32 and rounds the combination back once.
struct Float16Kernel {
  using Stored = std::uint16_t;
  static constexpr std::size_t kBlock = 2048;
  DType dtype;

  void dots(const std::uint16_t* a, const std::uint16_t* b, std::size_t n, double sums[3]) const {
    float x[kBlock], y[kBlock];
    for (std::size_t base = 0; base < n; base += kBlock) {
      const std::size_t m = std::min(kBlock, n - base);
      widen_to_float(a + base, x, m, dtype);
      widen_to_float(b + base, y, m, dtype);
      NativeKernel<float>{}.dots(x, y, m, sums);
    }
  }

  void combine(std::uint16_t* out, const std::uint16_t* a, const std::uint16_t* b, std::size_t n,
               double ac, double bc) const {
    float x[kBlock], y[kBlock];
    for (std::size_t base = 0; base < n; base += kBlock) {
      const std::size_t m = std::min(kBlock, n - base);
      widen_to_float(a + base, x, m, dtype);
      widen_to_float(b + base, y, m, dtype);
      NativeKernel<float>{}.combine(x, x, y, m, ac, bc);  // out may be a or b: read first
      narrow_from_float(x, out + base, m, dtype);
    }
  }
};

template <typename Kernel>
void adasum_tree(typename Kernel::Stored* v, std::size_t count, Transport& t, const Kernel& kernel) {
  using T = typename Kernel::Stored;
  const int P = t.size();
  const int r = t.rank();
  int levels = 0;
  while ((1 << levels) < P) ++levels;
  // Uninitialised: it is written by the exchange before it is read, and zeroing half the
  // vector would be one more pass over it.
  std::unique_ptr<T[]> received(new T[count / 2 + 1]);
  std::vector<Segment> kept(levels);
  Segment seg{0, count};
  for (int d = 0; d < levels; ++d) {
    const int dist = 1 << d;
    const int partner = r ^ dist;
    const bool lower = (r & dist) == 0;
    const std::size_t mid = seg.lo + (seg.hi - seg.lo) / 2;
    const Segment mine = lower ? Segment{seg.lo, mid} : Segment{mid, seg.hi};
    const Segment give = lower ? Segment{mid, seg.hi} : Segment{seg.lo, mid};
    const std::size_t n = mine.hi - mine.lo;
    t.sendrecv(v + give.lo, (give.hi - give.lo) * sizeof(T), partner, received.get(),
               n * sizeof(T), partner);
    const T* a = lower ? v + mine.lo : received.get();
    const T* b = lower ? received.get() : v + mine.lo;
    double sums[3] = {0.0, 0.0, 0.0};  // a.b, |a|^2, |b|^2 over this rank's piece
    kernel.dots(a, b, n, sums);
    // The pieces of the 2^(d+1) ranks combined at this level tile the whole vector.
    group_sum(sums, 3, d + 1, t);
    const double ac = coefficient(sums[0], sums[1]);
    const double bc = coefficient(sums[0], sums[2]);
    kernel.combine(v + mine.lo, a, b, n, ac, bc);
    kept[d] = mine;
    seg = mine;
  }
  // Gather the pieces back, widest distance first: partners hold the two halves of the
  // segment they split at that level.
  for (int d = levels - 1; d >= 0; --d) {
    const int partner = r ^ (1 << d);
    const Segment mine = kept[d];
    const Segment parent = d > 0 ? kept[d - 1] : Segment{0, count};
    const bool lower = (r & (1 << d)) == 0;
    const Segment theirs = lower ? Segment{mine.hi, parent.hi} : Segment{parent.lo, mine.lo};
    t.sendrecv(v + mine.lo, (mine.hi - mine.lo) * sizeof(T), partner, v + theirs.lo,
               (theirs.hi - theirs.lo) * sizeof(T), partner);
  }
  t.wait_all();
}

}  // namespace

void adasum_allreduce(void* buf, std::size_t count, DType dtype, Transport& t,
                      const AdasumOptions& o) {
  const int P = t.size();
  if (P < 1 || (P & (P - 1)) != 0) {
    throw InvalidArgument("Adasum needs a power-of-two number of ranks, not " +
                          std::to_string(P));
  }
  auto scaled = [&](auto* v, const auto& kernel) {
    scale_in_place(v, count, dtype, o.prescale);
    if (P > 1) adasum_tree(v, count, t, kernel);
    scale_in_place(v, count, dtype, o.postscale);
  };
  switch (dtype) {
    case DType::kFloat64: return scaled(static_cast<double*>(buf), NativeKernel<double>{});
    case DType::kFloat32: return scaled(static_cast<float*>(buf), NativeKernel<float>{});
    case DType::kFloat16:
    case DType::kBFloat16:
      return scaled(static_cast<std::uint16_t*>(buf), Float16Kernel{dtype});
    default:
      throw InvalidArgument(std::string("Adasum needs a floating-point buffer, not ") +
                            dtype_name(dtype));
  }
}

}  // namespace fusionring
