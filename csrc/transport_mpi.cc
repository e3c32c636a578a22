#include "transport_mpi.h"

#include <climits>
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

void MpiTransport::wait(Request request) {
  if (request < 0) return;
  MPI_Request& r = requests_.at(static_cast<std::size_t>(request));
  check(MPI_Wait(&r, MPI_STATUS_IGNORE), "MPI_Wait");
}

void MpiTransport::wait_all() {
  if (!requests_.empty()) {
    check(MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE),
          "MPI_Waitall");
  }
  requests_.clear();
}

}  // namespace fusionring
