#include "shm_allreduce.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "chunking.h"
#include "reduce.h"

namespace fusionring {
namespace {

constexpr std::size_t kLine = 64;

// A wait spins for a short while (a futex wake-up costs tens of microseconds; measured:
// 64 KiB at 2 ranks took 53 us with no spin, 12 us with 20 us of spin), then sleeps on a
// futex in the shared window, so a waiting rank gives its core to ranks still working.
// Sleeps are bounded so the clock and the peers' liveness get checked.
constexpr std::chrono::microseconds kSpinBeforeSleep{20};
constexpr int kSpinsBetweenClockReads = 64;
constexpr long kSleepNs = 50 * 1000 * 1000;

// Shared (not process-private) futex: the word lives in memory mapped by every rank.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long ns) {
  struct timespec timeout = {ns / 1000000000L, ns % 1000000000L};
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &timeout,
          nullptr, 0);
}
void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, 0x7fffffff, nullptr,
          nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The buffers' total bytes; each must hold a whole number of `esz`-byte elements.
std::size_t whole_elements(const std::vector<BufferView>& buffers, std::size_t esz) {
  std::size_t total = 0;
  for (const auto& v : buffers) {
    if (v.bytes % esz != 0) throw InvalidArgument("buffer size is not a whole number of elements");
    total += v.bytes;
  }
  return total;
}

std::size_t round_up(std::size_t value, std::size_t to) { return (value + to - 1) / to * to; }

// A process that has exited (or is a zombie waiting to be reaped) cannot arrive.
bool process_gone(long pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buffer[256] = {0};
  const std::size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  const char* close_paren = std::strrchr(buffer, ')');
  return n > 0 && close_paren && close_paren[1] == ' ' && close_paren[2] == 'Z';
}

// Copies bytes [offset, offset + bytes) of the concatenation of `views` to or from `flat`.
void copy_range(const std::vector<BufferView>& views, std::size_t offset, std::size_t bytes,
                char* flat, bool into_flat) {
  std::size_t start = 0;
  for (const auto& v : views) {
    const std::size_t end = start + v.bytes;
    if (end > offset && start < offset + bytes) {
      const std::size_t from = std::max(start, offset);
      const std::size_t to = std::min(end, offset + bytes);
      char* view = reinterpret_cast<char*>(v.address) + (from - start);
      char* slot = flat + (from - offset);
      if (into_flat) {
        std::memcpy(slot, view, to - from);
      } else {
        std::memcpy(view, slot, to - from);
      }
    }
    if (end >= offset + bytes) break;
    start = end;
  }
}

}  // namespace

// One cache line per rank, so arriving ranks never contend for a line.
struct alignas(kLine) RankLine {
  std::atomic<std::uint64_t> epoch;
  std::int64_t pid;
  // Per half of the double buffer, what the rank offered with the operation that uses it:
  // band_then_allreduce's bytes + 1, or 0 (band, an allreduce's piece). Written before the
  // operation's first wait, read after it; like the slot halves, rewritten only once every
  // rank has passed the next operation's wait.
  std::uint64_t offered[2];
};
static_assert(sizeof(RankLine) == kLine, "one cache line per rank");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

struct alignas(kLine) WakeLine {
  std::atomic<std::uint32_t> sequence;  // the futex word: bumped to wake sleepers
  std::atomic<std::uint32_t> sleepers;
};
static_assert(sizeof(std::atomic<std::uint32_t>) == 4, "futex words are 32-bit");

struct ShmAllreduce::Header {
  WakeLine wake;
  RankLine ranks[1];  // really size_ entries
};

ShmAllreduce::ShmAllreduce(MPI_Comm comm, std::size_t slot_bytes) {
  if (slot_bytes < 4096) throw InvalidArgument("shared-memory slot must be at least 4096 bytes");
  MPI_Comm_size(comm, &size_);
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  if (node_size != size_) {
    MPI_Comm_free(&node);
    throw InvalidArgument("shared-memory allreduce needs every rank on one host (" +
                          std::to_string(node_size) + " of " + std::to_string(size_) +
                          " ranks share this one)");
  }
  comm_ = node;  // same ranks in the same order (key = rank)
  slot_bytes_ = round_up(slot_bytes, kLine);
  const std::size_t header_bytes = round_up(kLine * static_cast<std::size_t>(size_ + 1), 4096);
  const std::size_t total = header_bytes + 2 * slot_bytes_ * static_cast<std::size_t>(size_);
  void* base = nullptr;
  // Rank 0 allocates the whole region; the others map it.
  int code = MPI_Win_allocate_shared(rank_ == 0 ? static_cast<MPI_Aint>(total) : 0, 1,
                                     MPI_INFO_NULL, comm_, &base, &win_);
  if (code != MPI_SUCCESS) {
    MPI_Comm_free(&comm_);
    throw CommunicationError("MPI_Win_allocate_shared of " + std::to_string(total) +
                             " bytes failed");
  }
  MPI_Aint size = 0;
  int disp = 0;
  MPI_Win_shared_query(win_, 0, &size, &disp, &base);
  char* region = static_cast<char*>(base);
  header_ = reinterpret_cast<Header*>(region);
  slots_ = region + header_bytes;
  if (rank_ == 0) {
    new (&header_->wake) WakeLine;
    header_->wake.sequence.store(0);
    header_->wake.sleepers.store(0);
    for (int r = 0; r < size_; ++r) {
      RankLine* line = new (&header_->ranks[0] + r) RankLine;
      line->epoch.store(0, std::memory_order_relaxed);
      line->pid = 0;
    }
  }
  // Fault the window in now, each rank its own slots first and then every page of it: the
  // allreduces touch every slot from every process, and otherwise the first of them pay a
  // page fault per 4 KiB each (the first two 1 MiB allreduces at 2 ranks took 1.5-2.5 ms
  // instead of 0.4 ms).
  for (int half = 0; half < 2; ++half) std::memset(slot(rank_, half), 0, slot_bytes_);
  MPI_Barrier(comm_);
  const std::size_t slots_total = 2 * slot_bytes_ * static_cast<std::size_t>(size_);
  const volatile char* window = slots_;  // volatile: the reads are the point
  for (std::size_t off = 0; off < slots_total; off += 4096) (void)window[off];
  (&header_->ranks[0] + rank_)->pid = static_cast<std::int64_t>(getpid());
  MPI_Barrier(comm_);
  // A peer whose pid this process cannot see (another pid namespace) is never declared dead.
  for (int r = 0; r < size_; ++r) {
    RankLine* line = &header_->ranks[0] + r;
    if (r != rank_ && process_gone(line->pid)) line->pid = -line->pid;
  }
  MPI_Barrier(comm_);
}

ShmAllreduce::~ShmAllreduce() {
  // MPI_Win_free synchronizes all ranks, and a rank may shut down while its peers have
  // already failed or left: freeing here could hang. close() frees it when every rank is
  // closing; otherwise MPI_Finalize releases it.
}

bool ShmAllreduce::close(double timeout_s) {
  if (win_ == MPI_WIN_NULL) return true;
  try {
    wait_for_all(++epoch_, timeout_s);
  } catch (const CommunicationError&) {
    return false;
  }
  MPI_Win_free(&win_);
  MPI_Comm_free(&comm_);
  header_ = nullptr;
  slots_ = nullptr;
  return true;
}

char* ShmAllreduce::slot(int rank, int half) const {
  return slots_ + (static_cast<std::size_t>(half) * static_cast<std::size_t>(size_) +
                   static_cast<std::size_t>(rank)) * slot_bytes_;
}

void ShmAllreduce::wait_for_all(std::uint64_t epoch, double timeout_s) {
  using clock = std::chrono::steady_clock;
  RankLine* lines = &header_->ranks[0];
  WakeLine& wake = header_->wake;
  lines[rank_].epoch.store(epoch, std::memory_order_seq_cst);
  // Only the rank that completes the wait wakes the sleepers: waking them at every arrival
  // would have each sleeper get up, find the wait still open and sleep again, up to P - 1
  // times per wait, each time taking a core from a rank still working. At least one of
  // the ranks arriving last sees every epoch (their stores and loads are sequentially
  // consistent), and a sleeper registers before it looks at the rank it sleeps on, so the
  // rank that finds the wait complete also finds the sleeper.
  bool complete = true;
  for (int r = 0; r < size_ && complete; ++r) {
    complete = lines[r].epoch.load(std::memory_order_seq_cst) >= epoch;
  }
  if (complete && wake.sleepers.load(std::memory_order_seq_cst) > 0) {
    wake.sequence.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&wake.sequence);
  }
  clock::time_point started{};
  bool timing = false;
  for (int r = 0; r < size_; ++r) {
    const auto spin_until = clock::now() + kSpinBeforeSleep;
    for (int spins = 1; lines[r].epoch.load(std::memory_order_acquire) < epoch; ++spins) {
      cpu_relax();
      if (spins % kSpinsBetweenClockReads == 0 && clock::now() >= spin_until) break;
    }
    while (true) {
      // Announce the sleep, then look again: an arriving rank either is seen here or
      // sees the sleeper and bumps the sequence, which cancels the futex wait.
      const std::uint32_t sequence = wake.sequence.load(std::memory_order_seq_cst);
      wake.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (lines[r].epoch.load(std::memory_order_seq_cst) >= epoch) {
        wake.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        break;
      }
      futex_wait(&wake.sequence, sequence, kSleepNs);
      wake.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (lines[r].epoch.load(std::memory_order_acquire) >= epoch) break;
      if (!timing) {
        started = clock::now();
        timing = true;
      }
      if (process_gone(lines[r].pid)) {
        throw CommunicationError("rank " + std::to_string(r) + " (pid " +
                                 std::to_string(lines[r].pid) +
                                 ") exited during a shared-memory allreduce; rank " +
                                 std::to_string(rank_) + " cannot complete it");
      }
      const double waited = std::chrono::duration<double>(clock::now() - started).count();
      if (timeout_s > 0 && waited > timeout_s) {
        throw CommunicationError("rank " + std::to_string(rank_) + " waited " +
                                 std::to_string(static_cast<int>(waited)) + " s for rank " +
                                 std::to_string(r) + " in a shared-memory allreduce");
      }
    }
  }
}

void ShmAllreduce::barrier(double timeout_s) {
  if (win_ == MPI_WIN_NULL) throw InvalidArgument("the shared-memory window has been closed");
  wait_for_all(++epoch_, timeout_s);
}

void ShmAllreduce::band(std::uint64_t* words, std::size_t count, double timeout_s) {
  if (win_ == MPI_WIN_NULL) throw InvalidArgument("the shared-memory window has been closed");
  if (count * sizeof(std::uint64_t) > slot_bytes_) {
    throw InvalidArgument("an AND of " + std::to_string(count) + " words does not fit a " +
                          std::to_string(slot_bytes_) + "-byte shared-memory slot");
  }
  // The halves alternate with every operation, so no rank can overwrite the half its peers
  // read here before they have all passed the next operation's wait.
  const int half = static_cast<int>(pieces_ & 1);
  std::memcpy(slot(rank_, half), words, count * sizeof(std::uint64_t));
  (&header_->ranks[0] + rank_)->offered[half] = 0;
  wait_for_all(++epoch_, timeout_s);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto* theirs = reinterpret_cast<const std::uint64_t*>(slot(r, half));
    for (std::size_t i = 0; i < count; ++i) words[i] &= theirs[i];
  }
  ++pieces_;
}

void ShmAllreduce::reduce_piece(const std::vector<BufferView>& buffers, std::size_t first,
                                std::size_t n, int half, std::size_t at, DType dtype, ReduceOp op,
                                const ShmAllreduceOptions& o) {
  // Each rank owns 1/P of the piece; rank 0's slot collects every result, added in rank
  // order whoever computes it.
  const std::size_t esz = element_size(dtype);
  const Chunking chunks(n, static_cast<std::size_t>(size_));
  const std::size_t begin = at + chunks.begin(static_cast<std::size_t>(rank_)) * esz;
  const std::size_t len = chunks.length(static_cast<std::size_t>(rank_));
  if (len) {
    char* acc = slot(0, half) + begin;
    for (int r = 1; r < size_; ++r) reduce_into(acc, slot(r, half) + begin, len, dtype, op);
    if (o.postscale != 1.0) scale_in_place(acc, len, dtype, o.postscale);
  }
  wait_for_all(++epoch_, o.timeout_s);
  copy_range(buffers, first * esz, n * esz, slot(0, half) + at, false);
  ++pieces_;
}

bool ShmAllreduce::band_then_allreduce(std::uint64_t* words, std::size_t count,
                                       const std::vector<BufferView>& buffers, DType dtype,
                                       ReduceOp op, const ShmAllreduceOptions& o) {
  if (win_ == MPI_WIN_NULL) throw InvalidArgument("the shared-memory window has been closed");
  const std::size_t esz = element_size(dtype);
  const std::size_t total = whole_elements(buffers, esz);
  const std::size_t data_at = round_up(count * sizeof(std::uint64_t), kLine);
  if (data_at + total > slot_bytes_) {
    throw InvalidArgument("an AND of " + std::to_string(count) + " words and " +
                          std::to_string(total) + " bytes do not fit a " +
                          std::to_string(slot_bytes_) + "-byte shared-memory slot");
  }
  const int half = static_cast<int>(pieces_ & 1);
  char* mine = slot(rank_, half);
  std::memcpy(mine, words, count * sizeof(std::uint64_t));
  const std::size_t n = total / esz;
  copy_range(buffers, 0, total, mine + data_at, true);
  if (o.prescale != 1.0) scale_in_place(mine + data_at, n, dtype, o.prescale);
  const std::uint64_t offered = total + 1;
  (&header_->ranks[0] + rank_)->offered[half] = offered;
  wait_for_all(++epoch_, o.timeout_s);

  // The words are the round's AND, as band() gives it. Whether the data is reduced too is
  // decided from what every rank reads alike: only when every rank offered data of the
  // same size (band() offers none) and every rank's words equal every other's (the same
  // tensors ready everywhere, so laid out alike).
  const auto* own = reinterpret_cast<const std::uint64_t*>(mine);
  const RankLine* lines = &header_->ranks[0];
  bool identical = true;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    identical = identical && lines[r].offered[half] == offered;
    const auto* theirs = reinterpret_cast<const std::uint64_t*>(slot(r, half));
    for (std::size_t i = 0; i < count; ++i) {
      identical = identical && theirs[i] == own[i];
      words[i] &= theirs[i];
    }
  }
  if (!identical) {
    ++pieces_;
    return false;
  }
  reduce_piece(buffers, 0, n, half, data_at, dtype, op, o);
  return true;
}

void ShmAllreduce::allreduce(const std::vector<BufferView>& buffers, DType dtype, ReduceOp op,
                             const ShmAllreduceOptions& o) {
  if (win_ == MPI_WIN_NULL) throw InvalidArgument("the shared-memory window has been closed");
  const std::size_t esz = element_size(dtype);
  const std::size_t total = whole_elements(buffers, esz);
  const std::size_t count = total / esz;
  const std::size_t piece_max = slot_bytes_ / esz;
  for (std::size_t done = 0; done < count;) {
    const std::size_t n = std::min(piece_max, count - done);
    const int half = static_cast<int>(pieces_ & 1);
    char* mine = slot(rank_, half);
    copy_range(buffers, done * esz, n * esz, mine, true);
    if (o.prescale != 1.0) scale_in_place(mine, n, dtype, o.prescale);
    (&header_->ranks[0] + rank_)->offered[half] = 0;
    wait_for_all(++epoch_, o.timeout_s);
    reduce_piece(buffers, done, n, half, 0, dtype, op, o);
    done += n;
  }
}

}  // namespace fusionring
