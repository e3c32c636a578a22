// Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation") over a
// Transport: vector halving with distance doubling, then the halves gathered back.
#pragma once

#include <cstddef>

#include "dtype.h"
#include "transport.h"

namespace fusionring {

struct AdasumOptions {
  double prescale = 1.0;   // applied to every rank's input first
  double postscale = 1.0;  // applied to the combined result
};

// In place: every rank ends with the same tree combination of all ranks' vectors, pairs
// at distance 1, 2, 4, ... each combined as (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b
// (a coefficient is 1 when its vector is zero, whatever the scale otherwise; a is the lower
// ranks' side). Dot products accumulate in double; 16-bit floats travel as they are and
// each level's result is rounded to them. Floating-point dtypes only; the
// number of ranks must be a power of two. Each level sends half the data of the one
// before, so a rank sends about 2 (P-1)/P of the vector in all.
void adasum_allreduce(void* buf, std::size_t count, DType dtype, Transport& transport,
                      const AdasumOptions& options);

}  // namespace fusionring
