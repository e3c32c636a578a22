// The point-to-point interface the collectives run over. MPI on CPU; NCCL can
// implement the same interface for device buffers.
#pragma once

#include <cstddef>
#include <vector>

namespace fusionring {

class Transport {
 public:
  using Request = int;  // index into the transport's request table; -1 means "nothing posted"

  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Nonblocking byte transfers. A zero-byte transfer posts nothing and returns -1,
  // so both sides must agree on sizes (they always do: sizes derive from shared counts).
  virtual Request isend(const void* buf, std::size_t bytes, int peer) = 0;
  virtual Request irecv(void* buf, std::size_t bytes, int peer) = 0;
  virtual void wait(Request request) = 0;
  virtual void wait_all() = 0;

  // Blocking exchange: send to `dst` while receiving from `src`.
  void sendrecv(const void* sendbuf, std::size_t sendbytes, int dst, void* recvbuf,
                std::size_t recvbytes, int src) {
    Request r = irecv(recvbuf, recvbytes, src);
    Request s = isend(sendbuf, sendbytes, dst);
    wait(r);
    wait(s);
  }
};

}  // namespace fusionring
