// Allreduce through shared memory, for a communicator whose ranks all live on one host.
//
// A ring over MPI's shared-memory transport copies every byte twice per hop (into MPI's
// cells and out again) and waits 2(P-1) times on its neighbours. Here each rank copies its
// input once into its slot of a shared window, reduces its own 1/P of every slot in place
// (in rank order, so the result is bitwise identical on every rank and from run to run),
// and copies the reduced result straight into its outputs: two waits per piece, no extra
// copies, and the fusion buffer's pack and unpack disappear into the first and last copy.
// Waits spin briefly and then yield the core, which matters when ranks outnumber cores.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "fusion_buffer.h"

namespace fusionring {

struct ShmAllreduceOptions {
  double prescale = 1.0;
  double postscale = 1.0;
  double timeout_s = 0.0;  // > 0: fail a wait that lasts longer (0: wait while peers live)
};

class ShmAllreduce {
 public:
  // Collective over `comm`. Throws InvalidArgument when the ranks do not share one host.
  // `slot_bytes` bounds the piece of the buffer reduced at a time (per rank, per half).
  ShmAllreduce(MPI_Comm comm, std::size_t slot_bytes);
  ~ShmAllreduce();
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::size_t slot_bytes() const { return slot_bytes_; }

  // Reduces the concatenation of `buffers` (each a whole number of elements of `dtype`)
  // across ranks and writes the result back into them. Every rank passes the same sizes.
  void allreduce(const std::vector<BufferView>& buffers, DType dtype, ReduceOp op,
                 const ShmAllreduceOptions& options);

  // Bitwise AND of `count` words across ranks, in place (the negotiation's round): one
  // wait, where an allreduce over MPI waits 2(P-1) times. Every rank passes the same count.
  void band(std::uint64_t* words, std::size_t count, double timeout_s = 0.0);
  // band() and, in the same wait, the allreduce of `buffers` (which must fit one slot
  // after the words): the data is reduced, and true returned, only when every rank called
  // this with identical words and the same number of bytes; otherwise (a rank called band(),
  // or passed other words or sizes) only the AND is done, exactly as band() does it, and
  // false is returned on every rank.
  bool band_then_allreduce(std::uint64_t* words, std::size_t count,
                           const std::vector<BufferView>& buffers, DType dtype, ReduceOp op,
                           const ShmAllreduceOptions& options);
  // Returns once every rank has called it (a shared-memory barrier).
  void barrier(double timeout_s = 0.0);

  // Frees the window, collectively: once every rank has reached close() (a shared-memory
  // barrier that fails instead of hanging when a peer has gone or `timeout_s` passes), every
  // rank calls MPI_Win_free. Returns false, keeping the window for MPI_Finalize, when the
  // barrier failed. Some transports (MPICH over libfabric) fail MPI_Finalize while a window is
  // still allocated. Nothing may be reduced afterwards.
  bool close(double timeout_s);

 private:
  struct Header;
  char* slot(int rank, int half) const;
  void wait_for_all(std::uint64_t epoch, double timeout_s);
  // After a piece's first wait: reduce this rank's 1/P of the `n` elements at byte `at` of
  // every slot's `half` into rank 0's, wait, copy the result into `buffers` from element
  // `first` on, and move to the other half.
  void reduce_piece(const std::vector<BufferView>& buffers, std::size_t first, std::size_t n,
                    int half, std::size_t at, DType dtype, ReduceOp op,
                    const ShmAllreduceOptions& options);

  MPI_Win win_ = MPI_WIN_NULL;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::size_t slot_bytes_ = 0;
  Header* header_ = nullptr;
  char* slots_ = nullptr;
  std::uint64_t epoch_ = 0;   // barriers passed by this rank
  std::uint64_t pieces_ = 0;  // pieces reduced; selects the half of the double buffer
};

}  // namespace fusionring
