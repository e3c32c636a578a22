// How the ring collectives split a buffer among ranks: one place, so the plain and the
// compressed ring always agree on chunk boundaries.
#pragma once

#include <algorithm>
#include <cstddef>

namespace fusionring {

// Splits `count` items into `parts` nearly equal contiguous chunks (the first
// count % parts chunks are one item longer).
struct Chunking {
  std::size_t count, parts, base, extra;
  Chunking(std::size_t count_, std::size_t parts_)
      : count(count_), parts(parts_), base(count_ / parts_), extra(count_ % parts_) {}
  std::size_t begin(std::size_t c) const { return c * base + std::min(c, extra); }
  std::size_t length(std::size_t c) const { return base + (c < extra ? 1 : 0); }
};

// a mod n for possibly negative a: ring neighbours and step indices.
inline std::size_t ring_mod(long long a, long long n) {
  return static_cast<std::size_t>(((a % n) + n) % n);
}

}  // namespace fusionring
