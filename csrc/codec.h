// What a compressed ring needs from a compression method: encode a run of float32 values
// into a self-contained payload, decode it (or decode and add), and the payload's size.
// The compressed ring (compressed_ring.h) moves payloads of any codec; a method adds only
// its kernels and a Codec over them (N:M per-rank masks, the cluster quantizer, ...).
#pragma once

#include <cstddef>

namespace fusionring {

class Codec {
 public:
  virtual ~Codec() = default;

  // Chunks and segments begin at multiples of this many elements (an N:M group, say).
  virtual std::size_t granule() const { return 1; }

  // Bytes of the payload of `count` elements: a function of `count` only, so sender and
  // receiver agree without asking, and a multiple of 8 so payloads can sit back to back.
  virtual std::size_t payload_bytes(std::size_t count) const = 0;

  // Encodes x[0, count) into `payload`. `at` is where x begins in the whole buffer (a codec
  // may derive per-segment randomness from it). When `residual` is not null it receives
  // x - decode(payload): what the encoding loses.
  virtual void encode(const float* x, std::size_t count, std::size_t at, void* payload,
                      float* residual) = 0;

  // out[i] = decoded value i.
  virtual void decode(const void* payload, std::size_t count, float* out) const = 0;
  // out[i] += decoded value i.
  virtual void decode_add(const void* payload, std::size_t count, float* out) const = 0;
};

}  // namespace fusionring
