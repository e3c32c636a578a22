#include "adasum.h"

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

template <typename T>
void adasum_typed(T* v, std::size_t count, Transport& t) {
  const int P = t.size();
  const int r = t.rank();
  int levels = 0;
  while ((1 << levels) < P) ++levels;
  std::vector<T> received(count / 2 + 1);
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
    t.sendrecv(v + give.lo, (give.hi - give.lo) * sizeof(T), partner, received.data(),
               n * sizeof(T), partner);
    const T* a = lower ? v + mine.lo : received.data();
    const T* b = lower ? received.data() : v + mine.lo;
    double sums[3] = {0.0, 0.0, 0.0};  // a.b, |a|^2, |b|^2 over this rank's piece
    for (std::size_t i = 0; i < n; ++i) {
      const double x = a[i], y = b[i];
      sums[0] += x * y;
      sums[1] += x * x;
      sums[2] += y * y;
    }
    // The pieces of the 2^(d+1) ranks combined at this level tile the whole vector.
    group_sum(sums, 3, d + 1, t);
    const double ac = sums[1] >= 1e-8 ? 1.0 - sums[0] / (2.0 * sums[1]) : 1.0;
    const double bc = sums[2] >= 1e-8 ? 1.0 - sums[0] / (2.0 * sums[2]) : 1.0;
    T* out = v + mine.lo;
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = static_cast<T>(ac * static_cast<double>(a[i]) + bc * static_cast<double>(b[i]));
    }
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
  auto scaled = [&](auto* v, DType type) {
    scale_in_place(v, count, type, o.prescale);
    if (P > 1) adasum_typed(v, count, t);
    scale_in_place(v, count, type, o.postscale);
  };
  if (dtype == DType::kFloat64) return scaled(static_cast<double*>(buf), dtype);
  if (dtype == DType::kFloat32) return scaled(static_cast<float*>(buf), dtype);
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    throw InvalidArgument(std::string("Adasum needs a floating-point buffer, not ") +
                          dtype_name(dtype));
  }
  // 16-bit floats are combined in float32 and rounded back once.
  const bool half = dtype == DType::kFloat16;
  auto* h = static_cast<std::uint16_t*>(buf);
  std::vector<float> wide(count);
  for (std::size_t i = 0; i < count; ++i) wide[i] = half ? half_to_float(h[i]) : bf16_to_float(h[i]);
  scaled(wide.data(), DType::kFloat32);
  for (std::size_t i = 0; i < count; ++i) h[i] = half ? float_to_half(wide[i]) : float_to_bf16(wide[i]);
}

}  // namespace fusionring
