// Transport over an MPI communicator handed over by the caller (e.g. from mpi4py).
#pragma once

#include <mpi.h>

#include <vector>

#include "transport.h"

namespace fusionring {

// How a rank waits for MPI requests. MPI_Wait polls nonstop; over a network that takes
// the CPU the kernel's TCP stack and the training thread need while bytes are in flight.
// With sleep_us > 0 the wait polls for spin_us, then sleeps between tests, each nap an eighth
// of the time waited so far (10 us at least, sleep_us at most).
struct WaitPolicy {
  long spin_us = 0;
  long sleep_us = 0;  // <= 0: MPI_Wait / MPI_Waitall
};

// Complete `requests` under `policy`; returns MPI's error code.
int wait_requests(int count, MPI_Request* requests, const WaitPolicy& policy);

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
  void set_wait_policy(const WaitPolicy& policy) { policy_ = policy; }
  const WaitPolicy& wait_policy() const { return policy_; }
  MPI_Comm comm() const { return comm_; }

 private:
  Request track(MPI_Request request);
  void check(int code, const char* what) const;

  MPI_Comm comm_;
  int tag_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<MPI_Request> requests_;
  WaitPolicy policy_;
};

}  // namespace fusionring
