// Cluster-and-hash gradient quantization: sampled 1-D K-means, scored hash buckets, a packed
// mapping table (SPEC section 3).
//
// One block of `count` float32 values encodes as follows (every step is deterministic given
// the block and a 64-bit `stream` seed):
//   1. Sample: `sample` indices drawn with replacement by splitmix64 from `stream`
//      (index = (r * count) >> 64 on the 64-bit draw r); a block of at most `sample` values
//      uses all of them. Non-finite sampled values are left out. The sample is sorted.
//   2. K-means on the sorted sample: K centres start at the sample's quantiles
//      sorted[(2j+1) S / 2K]; Lloyd's steps (at most kClusterLloydSteps) put boundary j at the
//      float32 midpoint (c_j + c_{j+1}) / 2 and each centre at the float32 of the float64 mean
//      of its run of the sample (an empty cluster keeps its centre). A value x belongs to
//      cluster id = #{ j : boundary_j < x } (NaN: cluster 0).
//   3. Score: per cluster its density (share of the sample), |centre| and the entropy (bits)
//      of its sample values in kClusterEntropyBins equal-width bins over the cluster's range;
//      each of the three is divided by its maximum over the clusters (all ones when that is 0)
//      and the three are multiplied.
//   4. Buckets: B in total, at least one per cluster; the other B - K are shared in proportion
//      to the scores (floor, then the largest remainders, ties to the lower cluster; evenly when
//      all scores are 0).
//   5. Assign and insert, one pass: value i goes to cluster id(i) and, within it, to bucket
//      ((h(i) >> 16) * buckets[id]) >> 16 with h(i) = uint32(i) * 0x9E3779B1 (i counted from
//      the block's start). A bucket keeps the sum and count of its values; its mean (0 when
//      empty) in `values` dtype is what element i decodes to.
// Payload: [bucket means, B x values dtype][buckets per cluster, K x uint16]
//          [ids, ceil(log2 K) bits each, little-endian bit stream][zero padding to 8 bytes].
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec.h"
#include "dtype.h"

namespace fusionring {

constexpr int kClusterMaxK = 256;
constexpr std::size_t kClusterMaxBuckets = 65535;
constexpr int kClusterLloydSteps = 32;
constexpr int kClusterEntropyBins = 8;

struct ClusterConfig {
  int k = 16;                         // clusters: 2..256
  std::size_t sample = 4096;          // sampled values for K-means: >= 1
  std::size_t buckets = 16;           // total buckets per block: k..65535
  DType values = DType::kFloat32;     // how bucket means travel: float32, float16, bfloat16
};

// Throws InvalidArgument naming the bad field.
void cluster_check(const ClusterConfig& config);
// ceil(log2 k): bits of one id in the mapping table.
int cluster_id_bits(int k);
// Payload bytes of a block of `count` values (0 for an empty block).
std::size_t cluster_payload_bytes(const ClusterConfig& config, std::size_t count);

// What encoding learnt besides the payload (for tests and reports).
struct ClusterEncodeInfo {
  float centres[kClusterMaxK];
};

// Encodes x[0, count) into `payload` (cluster_payload_bytes of it). When `residual` is not
// null it receives x - decode(payload). `info` may be null.
void cluster_encode(const float* x, std::size_t count, const ClusterConfig& config,
                    std::uint64_t stream, void* payload, float* residual,
                    ClusterEncodeInfo* info = nullptr);
// out[i] = decoded value i; with `add`, out[i] += it.
void cluster_decode(const void* payload, std::size_t count, const ClusterConfig& config,
                    float* out, bool add);

// The per-block stream seed: a mix of the compressor's seed, its step and where the block
// starts, so every block and step samples afresh and the same inputs give the same bits.
std::uint64_t cluster_stream(std::uint64_t seed, std::uint64_t step, std::uint64_t at);

// Which kernels run: 0 portable loops, 1 AVX2. All give the same bits. Returns the level now
// in use (at most what the CPU has).
int cluster_set_vector_level(int level);

// The quantizer as a codec for the compressed ring; `seed` and `step` pick the streams.
class ClusterCodec : public Codec {
 public:
  ClusterCodec(const ClusterConfig& config, std::uint64_t seed, std::uint64_t step)
      : config_(config), seed_(seed), step_(step) {}
  std::size_t payload_bytes(std::size_t count) const override {
    return cluster_payload_bytes(config_, count);
  }
  void encode(const float* x, std::size_t count, std::size_t at, void* payload,
              float* residual) override {
    // A rank encodes each block once per reduction, so (seed, step, at) names the stream.
    cluster_encode(x, count, config_, cluster_stream(seed_, step_, at), payload, residual);
  }
  void decode(const void* payload, std::size_t count, float* out) const override {
    cluster_decode(payload, count, config_, out, false);
  }
  void decode_add(const void* payload, std::size_t count, float* out) const override {
    cluster_decode(payload, count, config_, out, true);
  }

 private:
  ClusterConfig config_;
  std::uint64_t seed_, step_;
};

}  // namespace fusionring
