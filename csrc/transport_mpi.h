// Transport over an MPI communicator handed over by the caller (e.g. from mpi4py).
#pragma once

#include <mpi.h>

#include <atomic>
#include <vector>

#include "transport.h"

namespace fusionring {

// How a rank waits for MPI requests. MPI_Wait polls nonstop; over a network that takes
// the CPU the kernel's TCP stack and the training thread need while bytes are in flight.
// With sleep_us > 0 the wait tests for spin_us (yielding the core between tests), then sleeps
// between tests, each nap an eighth of the time waited so far (10 us at least, sleep_us at most).
struct WaitPolicy {
  long spin_us = 0;
  long sleep_us = 0;  // <= 0: MPI_Wait / MPI_Waitall
};

// How long a wait tests before it naps, learned from how long waits last. A wait that
// outlasts the budget (a late peer: a slower rank, an idle one that joins the next
// negotiation only at its next cycle) halves it, down to kFloorUs; a wait that ends in the
// second half of the budget doubles it, up to the policy's spin_us. Waits that end sooner
// leave it alone. So replies in flight keep a long budget, and a rank that keeps waiting on
// a late peer stops spending its spin budget on every wait.
class SpinBudget {
 public:
  static constexpr long kFloorUs = 250;
  void reset(long spin_us);
  long current() const { return budget_us_.load(std::memory_order_relaxed); }
  void record(long waited_us, bool napped);

 private:
  long max_us_ = 0;
  long floor_us_ = 0;
  std::atomic<long> budget_us_{0};
};

// Complete `requests` under `policy`; returns MPI's error code. With `budget`, the time
// spent testing before the naps is the budget's and the wait is recorded in it.
int wait_requests(int count, MPI_Request* requests, const WaitPolicy& policy,
                  SpinBudget* budget = nullptr);

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
  void set_wait_policy(const WaitPolicy& policy) {
    policy_ = policy;
    budget_.reset(policy.spin_us);
  }
  const WaitPolicy& wait_policy() const { return policy_; }
  SpinBudget* spin_budget() { return &budget_; }
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
  SpinBudget budget_;
};

}  // namespace fusionring
