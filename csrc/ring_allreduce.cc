#include "ring_allreduce.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "chunking.h"
#include "reduce.h"

namespace fusionring {
namespace {

inline std::size_t mod(long long a, long long n) { return ring_mod(a, n); }

// Receive scratch kept across calls. A fresh std::vector per call zero-fills and page-faults
// tens of MiB each time (at 64 MiB that doubled the ring's time). One buffer per thread, so
// concurrent callers never share it; it grows to the largest chunk seen and every byte read
// from it was first received into it.
char* scratch_bytes(std::size_t bytes) {
  thread_local std::unique_ptr<char[]> buffer;
  thread_local std::size_t capacity = 0;
  if (bytes > capacity) {
    buffer.reset();                 // release the old one before allocating the larger one
    buffer.reset(new char[bytes]);  // default-initialised: no zero fill
    capacity = bytes;
  }
  return buffer.get();
}

}  // namespace

void ring_allreduce(void* buf_, std::size_t count, DType dtype, ReduceOp op, Transport& t,
                    const AllreduceOptions& o) {
  const int P = t.size();
  const int r = t.rank();
  const std::size_t esz = element_size(dtype);
  char* buf = static_cast<char*>(buf_);
  scale_in_place(buf, count, dtype, o.prescale);
  if (P == 1 || count == 0) {
    scale_in_place(buf, count, dtype, o.postscale);
    return;
  }
  const Chunking chunks(count, static_cast<std::size_t>(P));
  const std::size_t seg = std::max<std::size_t>(1, o.segment_bytes / esz);
  const int right = (r + 1) % P;
  const int left = (r - 1 + P) % P;

  // Each segment of a chunk travels as its own message, so reducing one segment
  // overlaps the transfer of the next.
  auto for_segments = [&](std::size_t chunk, auto&& fn) {
    const std::size_t len = chunks.length(chunk);
    for (std::size_t k = 0, off = 0; off < len; ++k, off += seg) fn(k, off, std::min(seg, len - off));
  };

  // ---- reduce-scatter: after P-1 steps rank r owns the reduced chunk (r+1) mod P.
  const std::size_t max_chunk = chunks.length(0);
  // Two receive buffers alternate between steps; with two ranks there is only one step.
  const std::size_t buffers = P > 2 ? 2 : 1;
  char* scratch = scratch_bytes(buffers * max_chunk * esz);
  char* tmp[2] = {scratch, scratch + (buffers - 1) * max_chunk * esz};
  std::vector<std::vector<Transport::Request>> recv_reqs(2);

  auto post_reduce_scatter_recvs = [&](int step) {
    const std::size_t c = mod(r - step - 1, P);
    auto& reqs = recv_reqs[step % 2];
    reqs.clear();
    for_segments(c, [&](std::size_t, std::size_t off, std::size_t len) {
      reqs.push_back(t.irecv(tmp[step % 2] + off * esz, len * esz, left));
    });
  };

  for_segments(static_cast<std::size_t>(r), [&](std::size_t, std::size_t off, std::size_t len) {
    t.isend(buf + (chunks.begin(r) + off) * esz, len * esz, right);
  });
  post_reduce_scatter_recvs(0);
  for (int s = 0; s < P - 1; ++s) {
    if (s + 1 < P - 1) post_reduce_scatter_recvs(s + 1);
    const std::size_t c = mod(r - s - 1, P);
    char* chunk = buf + chunks.begin(c) * esz;
    const bool forward = s + 1 < P - 1;  // this chunk is what we send at step s+1
    for_segments(c, [&](std::size_t k, std::size_t off, std::size_t len) {
      t.wait(recv_reqs[s % 2][k]);
      reduce_into(chunk + off * esz, tmp[s % 2] + off * esz, len, dtype, op);
      if (forward) t.isend(chunk + off * esz, len * esz, right);
    });
  }
  t.wait_all();

  // The owner scales its chunk once; the allgather then spreads scaled values.
  const std::size_t own = mod(r + 1, P);
  scale_in_place(buf + chunks.begin(own) * esz, chunks.length(own), dtype, o.postscale);

  // ---- allgather: receive straight into place and forward each segment on arrival.
  std::vector<std::vector<Transport::Request>> ag_reqs(static_cast<std::size_t>(P - 1));
  for (int s = 0; s < P - 1; ++s) {
    const std::size_t c = mod(r - s, P);
    for_segments(c, [&](std::size_t, std::size_t off, std::size_t len) {
      ag_reqs[s].push_back(t.irecv(buf + (chunks.begin(c) + off) * esz, len * esz, left));
    });
  }
  for_segments(own, [&](std::size_t, std::size_t off, std::size_t len) {
    t.isend(buf + (chunks.begin(own) + off) * esz, len * esz, right);
  });
  for (int s = 0; s < P - 1; ++s) {
    const std::size_t c = mod(r - s, P);
    const bool forward = s + 1 < P - 1;
    for_segments(c, [&](std::size_t k, std::size_t off, std::size_t len) {
      t.wait(ag_reqs[s][k]);
      if (forward) t.isend(buf + (chunks.begin(c) + off) * esz, len * esz, right);
    });
  }
  t.wait_all();
}

void recursive_doubling_allreduce(void* buf_, std::size_t count, DType dtype, ReduceOp op,
                                  Transport& t, const AllreduceOptions& o) {
  const int P = t.size();
  const int r = t.rank();
  const std::size_t bytes = count * element_size(dtype);
  char* buf = static_cast<char*>(buf_);
  scale_in_place(buf, count, dtype, o.prescale);
  if (P > 1 && count > 0) {
    char* tmp = scratch_bytes(bytes);
    int pof2 = 1;
    while (pof2 * 2 <= P) pof2 *= 2;
    const int rem = P - pof2;
    // Fold the ranks beyond the largest power of two into their even neighbours.
    int newrank;
    if (r < 2 * rem) {
      if (r % 2 == 0) {
        t.sendrecv(buf, bytes, r + 1, nullptr, 0, r + 1);
        newrank = -1;
      } else {
        t.sendrecv(nullptr, 0, r - 1, tmp, bytes, r - 1);
        reduce_into(buf, tmp, count, dtype, op);
        newrank = r / 2;
      }
    } else {
      newrank = r - rem;
    }
    if (newrank >= 0) {
      // Both partners combine the same two operands; + and * commute exactly in IEEE
      // arithmetic, so every rank ends with the same bits.
      for (int mask = 1; mask < pof2; mask <<= 1) {
        const int np = newrank ^ mask;
        const int partner = np < rem ? np * 2 + 1 : np + rem;
        t.sendrecv(buf, bytes, partner, tmp, bytes, partner);
        reduce_into(buf, tmp, count, dtype, op);
      }
    }
    if (r < 2 * rem) {
      if (r % 2 == 1) {
        t.sendrecv(buf, bytes, r - 1, nullptr, 0, r - 1);
      } else {
        t.sendrecv(nullptr, 0, r + 1, buf, bytes, r + 1);
      }
    }
    t.wait_all();
  }
  scale_in_place(buf, count, dtype, o.postscale);
}

void allreduce(void* buf, std::size_t count, DType dtype, ReduceOp op, Transport& t,
               const AllreduceOptions& o) {
  const std::size_t bytes = count * element_size(dtype);
  if (bytes <= o.small_message_bytes || count < static_cast<std::size_t>(t.size())) {
    recursive_doubling_allreduce(buf, count, dtype, op, t, o);
  } else {
    ring_allreduce(buf, count, dtype, op, t, o);
  }
}

}  // namespace fusionring
