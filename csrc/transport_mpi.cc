#include "transport_mpi.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <ctime>
#include <string>

#include "dtype.h"

namespace fusionring {

MpiTransport::MpiTransport(MPI_Comm comm, int tag) : comm_(comm), tag_(tag) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw CommunicationError("MPI is not initialized");
  // Errors come back as codes so they become exceptions instead of aborting the job.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  requests_.reserve(256);
}

MpiTransport::~MpiTransport() {
  // Never leave requests dangling on the communicator.
  for (auto& r : requests_) {
    if (r != MPI_REQUEST_NULL) {
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
  }
}

void MpiTransport::check(int code, const char* what) const {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw CommunicationError(std::string(what) + " failed on rank " + std::to_string(rank_) + ": " +
                           std::string(text, len));
}

Transport::Request MpiTransport::track(MPI_Request request) {
  requests_.push_back(request);
  return static_cast<Request>(requests_.size() - 1);
}

Transport::Request MpiTransport::isend(const void* buf, std::size_t bytes, int peer) {
  if (bytes == 0) return -1;
  if (bytes > static_cast<std::size_t>(INT_MAX)) throw InvalidArgument("message over 2 GiB");
  MPI_Request r;
  check(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag_, comm_, &r), "MPI_Isend");
  return track(r);
}

Transport::Request MpiTransport::irecv(void* buf, std::size_t bytes, int peer) {
  if (bytes == 0) return -1;
  if (bytes > static_cast<std::size_t>(INT_MAX)) throw InvalidArgument("message over 2 GiB");
  MPI_Request r;
  check(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag_, comm_, &r), "MPI_Irecv");
  return track(r);
}

int wait_requests(int count, MPI_Request* requests, const WaitPolicy& policy) {
  if (policy.sleep_us <= 0) return MPI_Waitall(count, requests, MPI_STATUSES_IGNORE);
  const auto start = std::chrono::steady_clock::now();
  const auto spin = std::chrono::microseconds(policy.spin_us);
  // Naps grow from 10 us to sleep_us: a reply due soon is caught soon, and a long transfer
  // costs a test per sleep_us.
  long nap_us = std::min(10L, policy.sleep_us);
  while (true) {
    int done = 0;
    int code = MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS || done) return code;
    if (std::chrono::steady_clock::now() - start < spin) continue;
    const timespec nap{0, nap_us * 1000L};
    nanosleep(&nap, nullptr);
    nap_us = std::min(nap_us * 2, policy.sleep_us);
  }
}

void MpiTransport::wait(Request request) {
  if (request < 0) return;
  MPI_Request& r = requests_.at(static_cast<std::size_t>(request));
  check(wait_requests(1, &r, policy_), "MPI_Wait");
}

void MpiTransport::wait_all() {
  if (!requests_.empty()) {
    check(wait_requests(static_cast<int>(requests_.size()), requests_.data(), policy_),
          "MPI_Waitall");
  }
  requests_.clear();
}

}  // namespace fusionring
