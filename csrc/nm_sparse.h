// N:M structured sparsification kernels over raw buffers.
//
// In every run of M adjacent values (a group) the N of largest magnitude are kept. The kept
// values are packed densely, in element order, as float32, float16 or bfloat16; which ones were
// kept is a bit mask with one bit per element (bit i of the stream = element i), packed into
// little-endian 64-bit words, so each group owns M consecutive bits and 64/M groups share a
// word when M divides 64. A mask of `count` elements takes ceil(count / 64) words.
//
// Selection rule (bit-exact, the same on every path and on the GPU):
//   * magnitude is compared on the IEEE bits of |x| as an unsigned integer, so the order is
//     the order of |x|, -0 equals +0, and NaN ranks above infinity;
//   * on equal magnitude the lower index wins;
//   * the last group of a buffer whose length is not a multiple of M has L < M elements and
//     keeps min(N, L) of them (the same rule applied to the L elements present).
// The kept count of `count` elements is therefore (count / M) * N + min(N, count % M).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtype.h"

namespace fusionring {

constexpr int kNmMaxM = 32;

// Throws InvalidArgument unless 1 <= n <= m <= kNmMaxM.
void nm_check(int n, int m);
// Throws InvalidArgument unless `t` is float32, float16 or bfloat16; `what` names the argument.
void nm_check_float(DType t, const char* what);

// Values kept from `count` elements by N:M selection (see the tail rule above).
std::size_t nm_kept_count(std::size_t count, int n, int m);
// 64-bit words in the mask of `count` elements.
inline std::size_t nm_mask_words(std::size_t count) { return (count + 63) / 64; }
// Set bits among the first `count` bits of `mask`.
std::size_t nm_mask_popcount(const std::uint64_t* mask, std::size_t count);

// Selects N of every M of `src` (float32/float16/bfloat16), writes the mask and the kept values
// in `value_dtype`. When `residual` is not null it receives, as float32, what the packed form
// loses: src - unpack(values) (the dropped values, plus the rounding error of kept ones when the
// values are 16-bit). Returns the number of values written.
std::size_t nm_compress(const void* src, DType src_dtype, std::size_t count, int n, int m,
                        void* values, DType value_dtype, std::uint64_t* mask, float* residual);

// The mask nm_compress would write, without packing values.
void nm_select_mask(const void* src, DType src_dtype, std::size_t count, int n, int m,
                    std::uint64_t* mask);

// Packs the elements of `src` whose mask bit is set (any number per group), in element order;
// `residual` as in nm_compress. Returns the number of values written.
std::size_t nm_gather(const void* src, DType src_dtype, std::size_t count,
                      const std::uint64_t* mask, void* values, DType value_dtype, float* residual);

// Writes the packed values back to their masked positions of `out` and zeros elsewhere.
// Returns the number of values read.
std::size_t nm_scatter(const void* values, DType value_dtype, const std::uint64_t* mask,
                       std::size_t count, void* out, DType out_dtype);

// out[i] += value for masked positions (float32 accumulator). Returns the values read.
std::size_t nm_scatter_add(const void* values, DType value_dtype, const std::uint64_t* mask,
                           std::size_t count, float* out);

// Shared-mask bookkeeping (fusionring/compression/nm.py). Every rank holds the same per-element
// `estimate` of the reduced gradient and `wait` (steps since the element was last sent).
// nm_select_by_wait: the N:M mask of the scores |estimate| * (1 + wait).
void nm_select_by_wait(const float* estimate, const float* wait, std::size_t count, int n, int m,
                       std::uint64_t* mask);
// nm_track: after a reduction, sent elements take estimate = reduced / (1 + wait), wait = 0;
// the others keep their estimate and wait one step more.
void nm_track(float* estimate, float* wait, const float* reduced, const std::uint64_t* mask,
              std::size_t count);

// Which kernels run: 0 portable loops, 1 AVX2 (+F16C), 2 AVX-512 (F/BW/VL/DQ). The best the
// CPU has is chosen at load time; all give the same bits, and tests step down to check that.
// Returns the level now in use (at most what the CPU has).
int nm_set_vector_level(int level);
int nm_vector_level_available();

}  // namespace fusionring
