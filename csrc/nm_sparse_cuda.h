// N:M kernels on device buffers (csrc/nm_sparse.cu, built only with a CUDA compiler). They
// follow the selection rule and mask layout of nm_sparse.h; they need m dividing 32, a float32
// input, and masks with exactly N kept per full group (as N:M selection makes them), since
// value positions are computed from (n, m) instead of a prefix sum. `stream` is a
// cudaStream_t (0: the default stream); calls are asynchronous on it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtype.h"
#include "nm_sparse.h"

namespace fusionring {

// Select + pack; `values` null gives the mask only; `residual` (may be null) as on the CPU.
void nm_compress_cuda(const float* src, std::size_t count, int n, int m, void* values,
                      DType value_dtype, std::uint64_t* mask, float* residual, void* stream);
// Pack by a given (N:M-structured) mask.
void nm_gather_cuda(const float* src, std::size_t count, int n, int m, const std::uint64_t* mask,
                    void* values, DType value_dtype, float* residual, void* stream);
// Unpack to masked positions: zeros elsewhere, or added into `out` with `accumulate`.
void nm_scatter_cuda(const void* values, DType value_dtype, const std::uint64_t* mask,
                     std::size_t count, int n, int m, float* out, bool accumulate, void* stream);

}  // namespace fusionring
