/// \file
/// `gdr::bootstrap::mpi_rendezvous`: rank, size, `allgather` and `barrier`
/// from MPI (target `//gdr:mpi`, which links Open MPI). For jobs started by
/// `mpirun`/`srun` that already have MPI; `connect_mesh` then builds gdr's
/// own endpoints, and MPI is not used for data.
///
/// \code
///   gdr::bootstrap::mpi_rendezvous rv;   // MPI_Init if nobody did
///   gdr::scheduler sched;
///   auto mesh = gdr::sync_wait(sched, gdr::bootstrap::connect_mesh(sched, rv));
/// \endcode
///
/// Errors: the communicator is duplicated with `MPI_ERRORS_RETURN`, so an MPI
/// failure throws `gdr::error(errc::bootstrap_failed)` with MPI's message
/// instead of aborting the job. (A rank that never arrives still blocks the
/// collective: MPI offers no timeout; the launcher's own failure detection
/// applies.)
///
/// Thread-safety: one thread at a time per object; MPI is initialized with
/// `MPI_THREAD_FUNNELED` when this class initializes it.
#pragma once

// The C API only: Open MPI's (deprecated, removed in MPI-3) C++ bindings would
// need libmpi_cxx and do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gdr/bootstrap/rendezvous.hpp>
#include <gdr/error.hpp>

namespace gdr::bootstrap {

/// An MPI bootstrap; see the file comment. Satisfies `rendezvous`.
class mpi_rendezvous {
 public:
  /// Uses `MPI_COMM_WORLD`, calling `MPI_Init_thread` first if MPI is not
  /// initialized (then the destructor calls `MPI_Finalize`, unless someone
  /// already did). Throws `gdr::error(errc::bootstrap_failed)`.
  mpi_rendezvous() : mpi_rendezvous(MPI_COMM_WORLD, init_if_needed()) {}

  /// Uses a duplicate of `comm` (MPI must be initialized).
  explicit mpi_rendezvous(MPI_Comm comm) : mpi_rendezvous(comm, false) {}

  mpi_rendezvous(mpi_rendezvous&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), rank_(o.rank_), size_(o.size_),
        finalize_(std::exchange(o.finalize_, false)) {}
  mpi_rendezvous& operator=(mpi_rendezvous&&) = delete;
  mpi_rendezvous(const mpi_rendezvous&) = delete;
  mpi_rendezvous& operator=(const mpi_rendezvous&) = delete;

  ~mpi_rendezvous() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    if (finalize_) MPI_Finalize();
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  /// MPI does not say which address peers can reach: empty (the mesh then
  /// picks one; see `connect_mesh`).
  std::string address_hint() const { return {}; }

  /// Every rank's `mine`, indexed by rank: `MPI_Allgather` of the sizes, then
  /// `MPI_Allgatherv` of the bytes. The total must fit MPI's `int` counts.
  std::vector<std::vector<std::byte>> allgather(std::span<const std::byte> mine) {
    const auto n = static_cast<std::size_t>(size_);
    long long my_size = static_cast<long long>(mine.size());
    std::vector<long long> sizes(n);
    check(MPI_Allgather(&my_size, 1, MPI_LONG_LONG, sizes.data(), 1, MPI_LONG_LONG, comm_), "MPI_Allgather");
    std::vector<int> counts(n), displs(n);
    long long total = 0;
    for (std::size_t r = 0; r < n; ++r) {
      if (sizes[r] < 0 || total + sizes[r] > INT_MAX)
        throw error(errc::bootstrap_failed, "gdr::bootstrap::mpi_rendezvous::allgather: more than INT_MAX bytes in all");
      counts[r] = static_cast<int>(sizes[r]);
      displs[r] = static_cast<int>(total);
      total += sizes[r];
    }
    std::vector<std::byte> flat(static_cast<std::size_t>(total));
    // MPI_Allgatherv's send buffer is `const void*` since MPI-3.
    check(MPI_Allgatherv(mine.data(), counts[static_cast<std::size_t>(rank_)], MPI_BYTE, flat.data(), counts.data(),
                         displs.data(), MPI_BYTE, comm_),
          "MPI_Allgatherv");
    std::vector<std::vector<std::byte>> all(n);
    for (std::size_t r = 0; r < n; ++r)
      all[r].assign(flat.begin() + displs[r], flat.begin() + displs[r] + counts[r]);
    return all;
  }

  /// `MPI_Barrier` on the duplicated communicator.
  void barrier() { check(MPI_Barrier(comm_), "MPI_Barrier"); }

  /// The duplicated communicator (for code that wants MPI too).
  MPI_Comm comm() const noexcept { return comm_; }

 private:
  mpi_rendezvous(MPI_Comm comm, bool finalize) : finalize_(finalize) {
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  /// Initializes MPI unless done; true if this call did.
  static bool init_if_needed() {
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) return false;
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    return true;
  }

  static void check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw error(errc::bootstrap_failed, std::string("gdr::bootstrap::mpi_rendezvous: ") + what + ": " + msg);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  bool finalize_ = false;
};

static_assert(rendezvous<mpi_rendezvous>);

}  // namespace gdr::bootstrap
