// Allreduce over a Transport: a segmented, pipelined ring (reduce-scatter then
// allgather) for large buffers, recursive doubling for small ones.
#pragma once

#include <cstddef>

#include "dtype.h"
#include "transport.h"

namespace fusionring {

struct AllreduceOptions {
  double prescale = 1.0;                      // applied to every rank's input before reducing
  double postscale = 1.0;                     // applied to the reduced result
  std::size_t segment_bytes = 1 << 20;        // pipelining granularity of the ring
  std::size_t small_message_bytes = 64 << 10; // at or below this, recursive doubling
};

// In-place allreduce of `count` elements at `buf`. Every rank must pass the same count,
// dtype, op and options. The result is bitwise identical on all ranks.
void allreduce(void* buf, std::size_t count, DType dtype, ReduceOp op, Transport& transport,
               const AllreduceOptions& options);

// The two algorithms, exposed for tests and benchmarks.
void ring_allreduce(void* buf, std::size_t count, DType dtype, ReduceOp op, Transport& transport,
                    const AllreduceOptions& options);
void recursive_doubling_allreduce(void* buf, std::size_t count, DType dtype, ReduceOp op,
                                  Transport& transport, const AllreduceOptions& options);

}  // namespace fusionring
