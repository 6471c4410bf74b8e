/// \file
/// What every bootstrap offers: a rank, a world size, `allgather` of byte
/// strings and `barrier`. Two implementations: `tcp_rendezvous` (rank 0
/// listens, the others connect; `gdr/bootstrap/tcp_rendezvous.hpp`) and
/// `mpi_rendezvous` (`MPI_Allgatherv`; `gdr/bootstrap/mpi.hpp`, target
/// `//gdr:mpi`). `connect_mesh` (`gdr/bootstrap/mesh.hpp`) takes either.
///
/// Bootstrap is setup-time code: its calls block the calling thread, each
/// wait is bounded by a timeout, and failures throw `gdr::error` with
/// `errc::bootstrap_failed` and a sentence saying which rank did what.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace gdr::bootstrap {

/// A bootstrap: numbers the processes of a job and exchanges small setup
/// data among them.
///
/// Contract: `rank()` in `[0, size())`; `allgather(mine)` is collective (every
/// rank calls it, in the same order as every other collective) and returns
/// every rank's contribution indexed by rank (contributions may differ in
/// size); `barrier()` returns once every rank has entered it.
/// `address_hint()` is the address by which peers can reach this process, if
/// the bootstrap knows one (a TCP bootstrap does), else empty.
template <class R>
concept rendezvous = requires(R& r, const R& cr, std::span<const std::byte> mine) {
  { cr.rank() } -> std::convertible_to<int>;
  { cr.size() } -> std::convertible_to<int>;
  { r.allgather(mine) } -> std::same_as<std::vector<std::vector<std::byte>>>;
  { r.barrier() };
  { cr.address_hint() } -> std::convertible_to<std::string>;
};

}  // namespace gdr::bootstrap
