#include "nm_allreduce.h"

#include "codec.h"
#include "compressed_ring.h"
#include "nm_sparse.h"

namespace fusionring {
namespace {

// N:M with per-rank masks as a codec: a payload is [mask words][kept values][padding to 8
// bytes]; chunks and segments are whole groups of M.
class NmCodec : public Codec {
 public:
  NmCodec(int n, int m, DType values)
      : n_(n), m_(m), values_(values), vsize_(element_size(values)) {}

  std::size_t granule() const override { return static_cast<std::size_t>(m_); }
  std::size_t payload_bytes(std::size_t count) const override {
    const std::size_t bytes = nm_mask_words(count) * 8 + nm_kept_count(count, n_, m_) * vsize_;
    return (bytes + 7) / 8 * 8;
  }
  void encode(const float* x, std::size_t count, std::size_t, void* payload,
              float* residual) override {
    auto* mask = static_cast<std::uint64_t*>(payload);
    nm_compress(x, DType::kFloat32, count, n_, m_,
                static_cast<char*>(payload) + nm_mask_words(count) * 8, values_, mask, residual);
  }
  void decode(const void* payload, std::size_t count, float* out) const override {
    nm_scatter(values(payload, count), values_, mask(payload), count, out, DType::kFloat32);
  }
  void decode_add(const void* payload, std::size_t count, float* out) const override {
    nm_scatter_add(values(payload, count), values_, mask(payload), count, out);
  }

 private:
  static const std::uint64_t* mask(const void* payload) {
    return static_cast<const std::uint64_t*>(payload);
  }
  static const char* values(const void* payload, std::size_t count) {
    return static_cast<const char*>(payload) + nm_mask_words(count) * 8;
  }
  int n_, m_;
  DType values_;
  std::size_t vsize_;
};

}  // namespace

NmAllreduceStats nm_allreduce(float* buf, std::size_t count, float* residual, Transport& t,
                              const NmAllreduceOptions& o) {
  nm_check(o.n, o.m);
  nm_check_float(o.value_dtype, "N:M values");
  NmCodec codec(o.n, o.m, o.value_dtype);
  CompressedAllreduceOptions ring;
  ring.prescale = o.prescale;
  ring.postscale = o.postscale;
  ring.segment_bytes = o.segment_bytes;
  const CompressedAllreduceStats s = compressed_allreduce(buf, count, residual, t, codec, ring);
  NmAllreduceStats stats;
  stats.bytes_sent = s.bytes_sent;
  stats.bytes_received = s.bytes_received;
  return stats;
}

}  // namespace fusionring
