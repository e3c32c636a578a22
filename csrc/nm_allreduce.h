// Allreduce of N:M-compressed buffers whose masks differ per rank (the masks travel with the
// values), over a Transport.
#pragma once

#include <cstddef>

#include "dtype.h"
#include "transport.h"

namespace fusionring {

struct NmAllreduceOptions {
  int n = 2;
  int m = 4;
  DType value_dtype = DType::kFloat32;  // how kept values travel: float32, float16 or bfloat16
  double prescale = 1.0;                // applied to the input before error feedback
  double postscale = 1.0;               // applied to the reduced result
  std::size_t segment_bytes = 1 << 20;  // dense float32 bytes per message (pipelining)
};

struct NmAllreduceStats {
  std::size_t bytes_sent = 0;      // bytes this rank put on the wire
  std::size_t bytes_received = 0;  // bytes this rank took off the wire
};

// In-place sum of `count` float32 values at `buf` over all ranks, moving only N:M-compressed
// data (values + mask) around the compressed ring (compressed_ring.h, with the N:M codec):
//   * reduce-scatter: each hop unpacks the incoming chunk, adds it to this rank's own values,
//     selects N of every M again and sends that on; what the selection drops stays here;
//   * the owner of each reduced chunk selects N of M once more and the compressed chunks are
//     allgathered; every rank decodes the same bytes, so the result is identical everywhere
//     and has at most N nonzeros in each group of M.
// With `residual` (count floats, may be null) error feedback is on: the input becomes
// prescale * buf + residual, and `residual` is overwritten with everything this rank dropped,
// so   sum over ranks of (prescaled input + old residual) == result / postscale + sum of new
// residuals   (up to float32 rounding). Each rank sends about 2 (P-1)/P of the compressed size.
NmAllreduceStats nm_allreduce(float* buf, std::size_t count, float* residual, Transport& transport,
                              const NmAllreduceOptions& options);

}  // namespace fusionring
