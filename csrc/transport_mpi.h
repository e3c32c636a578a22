// Transport over an MPI communicator handed over by the caller (e.g. from mpi4py).
#pragma once

#include <mpi.h>

#include <vector>

#include "transport.h"

namespace fusionring {

class MpiTransport final : public Transport {
 public:
  // The communicator must stay valid while this object is used; `tag` separates this
  // transport's traffic from other users of the same communicator.
  explicit MpiTransport(MPI_Comm comm, int tag = 7301);
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Request isend(const void* buf, std::size_t bytes, int peer) override;
  Request irecv(void* buf, std::size_t bytes, int peer) override;
  void wait(Request request) override;
  void wait_all() override;

 private:
  Request track(MPI_Request request);
  void check(int code, const char* what) const;

  MPI_Comm comm_;
  int tag_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<MPI_Request> requests_;
};

}  // namespace fusionring
