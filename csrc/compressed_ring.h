// Allreduce (sum) of float32 buffers whose encodings are not summable (per-rank N:M masks,
// per-rank codebooks), generic over a Codec (codec.h), over a Transport.
#pragma once

#include <cstddef>

#include "codec.h"
#include "transport.h"

namespace fusionring {

struct CompressedAllreduceOptions {
  double prescale = 1.0;                // applied to the input before error feedback
  double postscale = 1.0;               // applied to the reduced result
  std::size_t segment_bytes = 1 << 20;  // dense float32 bytes per message (pipelining)
};

struct CompressedAllreduceStats {
  std::size_t bytes_sent = 0;      // bytes this rank put on the wire
  std::size_t bytes_received = 0;  // bytes this rank took off the wire
};

// In-place sum of `count` float32 values at `buf` over all ranks, moving only payloads of
// `codec` around the ring:
//   * reduce-scatter: each hop decodes the incoming chunk and adds it to this rank's own
//     values, encodes the sum again and sends that on; what encoding loses stays here;
//   * the owner of each reduced chunk encodes it once more and the encoded chunks are
//     allgathered; every rank decodes the same bytes, so the result is identical everywhere.
// Chunks travel as segments of about `segment_bytes` dense bytes, each one payload, so a
// segment is decoded as soon as it arrives.
// With `residual` (count floats, may be null) error feedback is on: the input becomes
// prescale * buf + residual, and `residual` is overwritten with everything this rank's
// encodings lost, so  sum over ranks of (prescaled input + old residual) == result /
// postscale + sum of new residuals  (up to float32 rounding).
CompressedAllreduceStats compressed_allreduce(float* buf, std::size_t count, float* residual,
                                              Transport& transport, Codec& codec,
                                              const CompressedAllreduceOptions& options);

}  // namespace fusionring
