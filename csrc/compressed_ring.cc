#include "compressed_ring.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "chunking.h"
#include "reduce.h"

namespace fusionring {
namespace {

inline std::size_t mod(long long a, long long n) { return ring_mod(a, n); }

// The layout of the buffer on the wire. Chunks are whole granules (the tail granule, if any,
// is in the last chunk); a chunk travels as segments of at most `segment` elements, each one
// payload. Sizes derive from counts only, so sender and receiver agree without asking.
struct WireLayout {
  std::size_t count, granule, segment;
  const Codec& codec;
  Chunking granules;

  WireLayout(std::size_t count_, const Codec& codec_, std::size_t segment_bytes, int parts)
      : count(count_),
        granule(std::max<std::size_t>(1, codec_.granule())),
        segment(std::max<std::size_t>(1, segment_bytes / (4 * granule)) * granule),
        codec(codec_),
        granules((count_ + granule - 1) / granule, static_cast<std::size_t>(parts)) {}

  std::size_t begin(std::size_t c) const { return std::min(granules.begin(c) * granule, count); }
  std::size_t end(std::size_t c) const {
    return std::min((granules.begin(c) + granules.length(c)) * granule, count);
  }
  std::size_t message_bytes(std::size_t len) const { return codec.payload_bytes(len); }
  std::size_t chunk_bytes(std::size_t c) const {
    std::size_t total = 0;
    for_segments(c, [&](std::size_t, std::size_t, std::size_t len, std::size_t) {
      total += message_bytes(len);
    });
    return total;
  }
  // fn(k, first element, elements, wire offset within the chunk's image)
  template <typename Fn>
  void for_segments(std::size_t c, Fn&& fn) const {
    const std::size_t b = begin(c), e = end(c);
    std::size_t wire = 0, k = 0;
    for (std::size_t at = b; at < e; at += segment, ++k) {
      const std::size_t len = std::min(segment, e - at);
      fn(k, at, len, wire);
      wire += message_bytes(len);
    }
  }
};

}  // namespace

CompressedAllreduceStats compressed_allreduce(float* buf, std::size_t count, float* residual,
                                              Transport& t, Codec& codec,
                                              const CompressedAllreduceOptions& o) {
  CompressedAllreduceStats stats;
  scale_in_place(buf, count, DType::kFloat32, o.prescale);
  if (residual) reduce_into(buf, residual, count, DType::kFloat32, ReduceOp::kSum);
  if (count == 0) return stats;

  const int P = t.size();
  const int r = t.rank();
  const WireLayout layout(count, codec, o.segment_bytes, P);

  std::size_t slot_bytes = 0;
  for (std::size_t c = 0; c < static_cast<std::size_t>(P); ++c) {
    slot_bytes = std::max(slot_bytes, layout.chunk_bytes(c));
  }
  slot_bytes = (slot_bytes + 7) / 8 * 8;
  // P + 1 slots: the reduce-scatter's P-1 outgoing images and two incoming ones; afterwards
  // slot c holds chunk c for the allgather. uint64_t storage keeps every payload 8-byte
  // aligned (payload sizes are multiples of 8).
  std::vector<std::uint64_t> storage((static_cast<std::size_t>(P) + 1) * slot_bytes / 8);
  auto slot = [&](std::size_t i) {
    return reinterpret_cast<char*>(storage.data()) + i * slot_bytes;
  };

  auto encode_into = [&](char* image, std::size_t at, std::size_t len) {
    codec.encode(buf + at, len, at, image, residual ? residual + at : nullptr);
  };
  auto decode_from = [&](const char* image, std::size_t at, std::size_t len, bool add) {
    if (add) {
      codec.decode_add(image, len, buf + at);
    } else {
      codec.decode(image, len, buf + at);
    }
  };
  auto send = [&](const char* image, std::size_t len, int peer) {
    const std::size_t bytes = layout.message_bytes(len);
    stats.bytes_sent += bytes;
    t.isend(image, bytes, peer);
  };

  if (P == 1) {
    layout.for_segments(0, [&](std::size_t, std::size_t at, std::size_t len, std::size_t wire) {
      encode_into(slot(0) + wire, at, len);
      decode_from(slot(0) + wire, at, len, false);
    });
    scale_in_place(buf, count, DType::kFloat32, o.postscale);
    return stats;
  }

  const int right = (r + 1) % P;
  const int left = (r - 1 + P) % P;

  // ---- reduce-scatter: after P-1 steps rank r holds the dense sum of chunk (r+1) mod P.
  std::vector<std::vector<Transport::Request>> recv_reqs(2);
  auto incoming = [&](int step) { return slot(static_cast<std::size_t>(P - 1 + step % 2)); };
  auto post_reduce_scatter_recvs = [&](int step) {
    const std::size_t c = mod(r - step - 1, P);
    auto& reqs = recv_reqs[static_cast<std::size_t>(step % 2)];
    reqs.clear();
    layout.for_segments(c, [&](std::size_t, std::size_t, std::size_t len, std::size_t wire) {
      const std::size_t bytes = layout.message_bytes(len);
      stats.bytes_received += bytes;
      reqs.push_back(t.irecv(incoming(step) + wire, bytes, left));
    });
  };

  layout.for_segments(static_cast<std::size_t>(r),
                      [&](std::size_t, std::size_t at, std::size_t len, std::size_t wire) {
                        encode_into(slot(0) + wire, at, len);
                        send(slot(0) + wire, len, right);
                      });
  post_reduce_scatter_recvs(0);
  for (int s = 0; s < P - 1; ++s) {
    if (s + 1 < P - 1) post_reduce_scatter_recvs(s + 1);
    const std::size_t c = mod(r - s - 1, P);
    const bool forward = s + 1 < P - 1;  // this chunk is what we send at step s+1
    layout.for_segments(c, [&](std::size_t k, std::size_t at, std::size_t len, std::size_t wire) {
      t.wait(recv_reqs[static_cast<std::size_t>(s % 2)][k]);
      decode_from(incoming(s) + wire, at, len, true);
      if (forward) {
        char* out = slot(static_cast<std::size_t>(s + 1)) + wire;
        encode_into(out, at, len);
        send(out, len, right);
      }
    });
  }
  t.wait_all();

  // ---- allgather of encoded chunks: the owner encodes its sum once and decodes its own
  // image, so every rank's result comes from the same bytes.
  const std::size_t own = mod(r + 1, P);
  std::vector<std::vector<Transport::Request>> ag_reqs(static_cast<std::size_t>(P - 1));
  for (int s = 0; s < P - 1; ++s) {
    const std::size_t c = mod(r - s, P);
    layout.for_segments(c, [&](std::size_t, std::size_t, std::size_t len, std::size_t wire) {
      const std::size_t bytes = layout.message_bytes(len);
      stats.bytes_received += bytes;
      ag_reqs[static_cast<std::size_t>(s)].push_back(t.irecv(slot(c) + wire, bytes, left));
    });
  }
  layout.for_segments(own, [&](std::size_t, std::size_t at, std::size_t len, std::size_t wire) {
    encode_into(slot(own) + wire, at, len);
    send(slot(own) + wire, len, right);
    decode_from(slot(own) + wire, at, len, false);
  });
  for (int s = 0; s < P - 1; ++s) {
    const std::size_t c = mod(r - s, P);
    const bool forward = s + 1 < P - 1;
    layout.for_segments(c, [&](std::size_t k, std::size_t at, std::size_t len, std::size_t wire) {
      t.wait(ag_reqs[static_cast<std::size_t>(s)][k]);
      if (forward) send(slot(c) + wire, len, right);
      decode_from(slot(c) + wire, at, len, false);
    });
  }
  t.wait_all();
  scale_in_place(buf, count, DType::kFloat32, o.postscale);
  return stats;
}

}  // namespace fusionring
