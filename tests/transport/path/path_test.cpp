// gdr/transfer/path.hpp: every row of today's transports as a compile-time
// table, the staged and probed kinds through a test transport, forcing a path,
// the decision record and its log line. Built twice (BUILD.bazel): without
// GDR_LOG and with GDR_LOG=tcp,path; the logging test checks whichever it got.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

#include <gdr/error.hpp>
#include <gdr/transport/loopback.hpp>
#include <gdr/transfer/path.hpp>
#include <gdr/transport/tcp.hpp>
#include "tests/support/capture_stderr.hpp"

using gdr::AnySpace;
using gdr::Device;
using gdr::errc;
using gdr::force_path;
using gdr::Host;
using gdr::path_kind;
using gdr::Pinned;
using gdr::Remote;
using gdr::transfer_path;

// ------------------------------------------------- a transport with every kind

// A test transport whose rows use the kinds today's transports do not:
// sending device memory is probed (GPUDirect), receiving it staged.
struct probing_transport;

namespace gdr {
template <>
inline constexpr const char* transport_name_v<probing_transport> = "probing";
template <class Op>
struct path_table<probing_transport, Op, Host, AnySpace>
    : path_row<path_kind::zero_copy, transfer_path::host_zero_copy> {};
template <>
struct path_table<probing_transport, op::send, Device, AnySpace>
    : path_row<path_kind::probed, transfer_path::gpudirect_rdma> {};
template <>
struct path_table<probing_transport, op::recv, Device, AnySpace>
    : path_row<path_kind::staged, transfer_path::staged_pinned> {};
}  // namespace gdr

namespace {

template <class T, class Op, class L, class R>
constexpr bool zero_copy_row = gdr::select_path_v<T, Op, L, R> == path_kind::zero_copy &&
                               gdr::select_path<T, Op, L, R>::path == transfer_path::host_zero_copy;

// The row is unsupported, and diagnosed by `Diagnostic` (compared as a type:
// its static_assert is not run).
template <class T, class Op, class L, class R>
constexpr bool staged_row = gdr::select_path_v<T, Op, L, R> == path_kind::staged &&
                            gdr::select_path<T, Op, L, R>::path == gdr::transfer_path::staged_pinned;

template <class T, class Op, class L, class R, template <class, class, class, class> class Diagnostic>
constexpr bool unsupported_row = gdr::select_path_v<T, Op, L, R> == path_kind::unsupported &&
                                 std::is_same_v<typename gdr::select_path<T, Op, L, R>::template diagnostic<T, Op, L, R>,
                                                Diagnostic<T, Op, L, R>>;

using gdr::path_error::A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_;
using gdr::path_error::NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_;

// Every row of one operation on a transport whose bytes the CPU moves
// (loopback, tcp): local space down, remote space across.
template <class T, class Op>
constexpr bool cpu_transport_rows_hold() {
  constexpr bool two_sided = gdr::two_sided_operation<Op>;
  //                          local    remote
  static_assert(zero_copy_row<T, Op, Host, Host>);
  static_assert(zero_copy_row<T, Op, Host, Pinned>);
  static_assert(staged_row<T, Op, Host, Device>);  // the peer stages
  if constexpr (two_sided) {
    static_assert(zero_copy_row<T, Op, Host, AnySpace>);
  } else {  // put and get name the peer's space
    static_assert(unsupported_row<T, Op, Host, AnySpace, NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_>);
  }

  static_assert(zero_copy_row<T, Op, Pinned, Host>);
  static_assert(zero_copy_row<T, Op, Pinned, Pinned>);
  static_assert(staged_row<T, Op, Pinned, Device>);
  if constexpr (two_sided) {
    static_assert(zero_copy_row<T, Op, Pinned, AnySpace>);
  } else {  // put and get name the peer's space
    static_assert(unsupported_row<T, Op, Pinned, AnySpace, NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_>);
  }

  // Device memory is staged through Pinned bounce buffers (the protocol
  // layer's pipeline), whatever the other side.
  static_assert(staged_row<T, Op, Device, Host>);
  static_assert(staged_row<T, Op, Device, Pinned>);
  static_assert(staged_row<T, Op, Device, Device>);
  static_assert(staged_row<T, Op, Device, AnySpace>);

  static_assert(unsupported_row<T, Op, Remote<Host>, Host, A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_>);
  static_assert(unsupported_row<T, Op, Remote<Pinned>, Pinned, A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_>);
  static_assert(unsupported_row<T, Op, Remote<Device>, Device, A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_>);
  static_assert(unsupported_row<T, Op, Remote<Host>, AnySpace, A_REMOTE_VIEW_IS_NOT_A_LOCAL_BUFFER_>);
  return true;
}

template <class T>
constexpr bool cpu_transport_table_holds() {
  return cpu_transport_rows_hold<T, gdr::op::send>() && cpu_transport_rows_hold<T, gdr::op::recv>() &&
         cpu_transport_rows_hold<T, gdr::op::put>() && cpu_transport_rows_hold<T, gdr::op::get>();
}

static_assert(cpu_transport_table_holds<gdr::tcp::transport>());
static_assert(cpu_transport_table_holds<gdr::loopback::transport>());

// A transport with no rows: the conservative default everywhere.
struct rowless_transport;
static_assert(unsupported_row<rowless_transport, gdr::op::send, Host, AnySpace,
                              NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_>);
static_assert(unsupported_row<rowless_transport, gdr::op::put, Pinned, Pinned,
                              NO_PATH_FOR_THIS_TRANSPORT_OPERATION_AND_SPACES_>);
static_assert(!gdr::has_path<rowless_transport, gdr::op::send, Host>);

// require_path gives the row's kind for every kind that compiles.
static_assert(gdr::require_path<gdr::tcp::transport, gdr::op::send, Host>() == path_kind::zero_copy);
static_assert(gdr::require_path<gdr::loopback::transport, gdr::op::get, Pinned, Host>() == path_kind::zero_copy);
static_assert(gdr::require_path<probing_transport, gdr::op::send, Device>() == path_kind::probed);
static_assert(gdr::require_path<probing_transport, gdr::op::recv, Device>() == path_kind::staged);
static_assert(gdr::has_path<probing_transport, gdr::op::recv, Device>);
static_assert(!gdr::has_path<probing_transport, gdr::op::put, Device>);
static_assert(gdr::has_path<gdr::tcp::transport, gdr::op::put, Host, Pinned>);
static_assert(gdr::require_path<gdr::tcp::transport, gdr::op::send, Device>() == path_kind::staged);
static_assert(gdr::require_path<gdr::loopback::transport, gdr::op::put, Host, Device>() == path_kind::staged);

// Operations: tags and names.
static_assert(gdr::path_operation<gdr::op::get>);
static_assert(!gdr::path_operation<Host>);
static_assert(gdr::two_sided_operation<gdr::op::recv>);
static_assert(!gdr::two_sided_operation<gdr::op::put>);
static_assert(std::string_view(gdr::to_string(gdr::op::put::kind)) == "put");
static_assert(std::string_view(gdr::to_string(gdr::op::recv::kind)) == "recv");

// Names printed in decisions.
static_assert(std::string_view(gdr::space_name<Host>()) == "Host");
static_assert(std::string_view(gdr::space_name<Pinned>()) == "Pinned");
static_assert(std::string_view(gdr::space_name<Device>()) == "Device");
static_assert(std::string_view(gdr::space_name<Remote<Device>>()) == "Remote<Device>");
static_assert(std::string_view(gdr::space_name<AnySpace>()) == "any");
static_assert(std::string_view(gdr::transport_name_v<gdr::tcp::transport>) == "tcp");
static_assert(std::string_view(gdr::transport_name_v<gdr::loopback::transport>) == "loopback");

// What each row offers to each forced path: never a downgrade.
static_assert(gdr::path_offered(path_kind::zero_copy, force_path::automatic));
static_assert(gdr::path_offered(path_kind::zero_copy, force_path::zero_copy));
static_assert(!gdr::path_offered(path_kind::zero_copy, force_path::staged));
static_assert(gdr::path_offered(path_kind::staged, force_path::automatic));
static_assert(!gdr::path_offered(path_kind::staged, force_path::zero_copy));
static_assert(gdr::path_offered(path_kind::staged, force_path::staged));
static_assert(gdr::path_offered(path_kind::probed, force_path::automatic));
static_assert(gdr::path_offered(path_kind::probed, force_path::zero_copy));
static_assert(!gdr::path_offered(path_kind::probed, force_path::staged));
static_assert(!gdr::path_offered(path_kind::unsupported, force_path::automatic));
static_assert(!gdr::path_offered(path_kind::unsupported, force_path::zero_copy));
static_assert(!gdr::path_offered(path_kind::unsupported, force_path::staged));

// GDR_LOG parsing.
static_assert(gdr::detail::log_spec_names("path", "path"));
static_assert(gdr::detail::log_spec_names("tcp,path", "path"));
static_assert(gdr::detail::log_spec_names("tcp path", "path"));
static_assert(gdr::detail::log_spec_names("tcp:path:sched", "path"));
static_assert(gdr::detail::log_spec_names("all", "path"));
static_assert(!gdr::detail::log_spec_names("", "path"));
static_assert(!gdr::detail::log_spec_names("paths", "path"));
static_assert(!gdr::detail::log_spec_names("tcp,,sched", "path"));
static_assert(!gdr::detail::log_spec_names("xpath", "path"));

// A probe that counts its calls and answers `answer`.
struct counting_probe {
  int* calls;
  std::error_code answer;
  std::error_code operator()() const noexcept {
    ++*calls;
    return answer;
  }
};

using gdr_test_support::capture_stderr;

}  // namespace

TEST_CASE("path_allowed refuses a forced path the row does not offer with errc::unsupported") {
  CHECK(!gdr::path_allowed(path_kind::zero_copy, force_path::automatic));
  CHECK(!gdr::path_allowed(path_kind::zero_copy, force_path::zero_copy));
  CHECK(gdr::path_allowed(path_kind::zero_copy, force_path::staged) == errc::unsupported);
  CHECK(!gdr::path_allowed(path_kind::staged, force_path::staged));
  CHECK(gdr::path_allowed(path_kind::staged, force_path::zero_copy) == errc::unsupported);
  CHECK(!gdr::path_allowed(path_kind::probed, force_path::zero_copy));
  CHECK(gdr::path_allowed(path_kind::probed, force_path::staged) == errc::unsupported);
  CHECK(gdr::path_allowed(path_kind::unsupported, force_path::automatic) == errc::unsupported);
}

TEST_CASE("decide_path records a zero-copy row of tcp as it is, without probing") {
  int calls = 0;
  auto d = gdr::decide_path<gdr::tcp::transport, gdr::op::send, Pinned>(force_path::automatic,
                                                                         counting_probe{&calls, {}});
  REQUIRE(d.has_value());
  CHECK(std::string_view(d->transport) == "tcp");
  CHECK(d->operation == gdr::op_kind::send);
  CHECK(std::string_view(d->local_space) == "Pinned");
  CHECK(std::string_view(d->remote_space) == "any");
  CHECK(d->row == path_kind::zero_copy);
  CHECK(d->decided == path_kind::zero_copy);
  CHECK(d->path == transfer_path::host_zero_copy);
  CHECK(d->force == force_path::automatic);
  CHECK(d->endpoint == nullptr);
  CHECK(calls == 0);
  auto put = gdr::decide_path<gdr::loopback::transport, gdr::op::put, Host, Pinned>(force_path::zero_copy);
  REQUIRE(put.has_value());
  CHECK(put->operation == gdr::op_kind::put);
  CHECK(std::string_view(put->remote_space) == "Pinned");
  CHECK(put->force == force_path::zero_copy);
}

TEST_CASE("decide_path never downgrades: forcing staging on a zero-copy row is a set-up error") {
  auto d = gdr::decide_path<gdr::tcp::transport, gdr::op::recv, Host>(force_path::staged);
  REQUIRE(!d.has_value());
  CHECK(d.error() == errc::unsupported);
  auto z = gdr::decide_path<probing_transport, gdr::op::recv, Device>(force_path::zero_copy);
  REQUIRE(!z.has_value());
  CHECK(z.error() == errc::unsupported);
  auto s = gdr::decide_path<probing_transport, gdr::op::recv, Device>(force_path::staged);
  REQUIRE(s.has_value());
  CHECK(s->decided == path_kind::staged);
  CHECK(s->path == transfer_path::staged_pinned);
  CHECK(s->force == force_path::staged);
}

TEST_CASE("decide_path resolves a probed row by probing once, and a failed probe is the set-up error") {
  int calls = 0;
  SUBCASE("the probe says yes: zero-copy") {
    auto d = gdr::decide_path<probing_transport, gdr::op::send, Device>(force_path::automatic,
                                                                        counting_probe{&calls, {}});
    REQUIRE(d.has_value());
    CHECK(calls == 1);
    CHECK(d->row == path_kind::probed);
    CHECK(d->decided == path_kind::zero_copy);
    CHECK(d->path == transfer_path::gpudirect_rdma);
  }
  SUBCASE("the probe says no: its error, not a staged path") {
    auto d = gdr::decide_path<probing_transport, gdr::op::send, Device>(
        force_path::zero_copy, counting_probe{&calls, gdr::make_error_code(errc::gpudirect_unavailable)});
    REQUIRE(!d.has_value());
    CHECK(calls == 1);
    CHECK(d.error() == errc::gpudirect_unavailable);
  }
  SUBCASE("staging forced on a probed row is refused before probing") {
    auto d = gdr::decide_path<probing_transport, gdr::op::send, Device>(force_path::staged,
                                                                        counting_probe{&calls, {}});
    REQUIRE(!d.has_value());
    CHECK(calls == 0);
    CHECK(d.error() == errc::unsupported);
  }
  SUBCASE("without a probe, a probed row cannot be decided") {
    auto d = gdr::decide_path<probing_transport, gdr::op::send, Device>();
    REQUIRE(!d.has_value());
    CHECK(d.error() == errc::unsupported);
  }
}

TEST_CASE("an unsupported row compiles in decide_path and is refused at run time") {
  auto d = gdr::decide_path<rowless_transport, gdr::op::send, Host>();
  REQUIRE(!d.has_value());
  CHECK(d.error() == errc::unsupported);
  auto p = gdr::decide_path<probing_transport, gdr::op::put, Host, Host>();
  REQUIRE(!p.has_value());
  CHECK(p.error() == errc::unsupported);
}

TEST_CASE("a decision prints as one line naming transport, endpoint, operation, spaces and path") {
  auto d = gdr::decide_path<gdr::tcp::transport, gdr::op::send, Pinned>().value();
  CHECK(gdr::to_string(d) == "gdr path: tcp send Pinned -> any: zero-copy (host-zero-copy)");
  d.endpoint = "10.0.0.2:4791";
  CHECK(gdr::to_string(d) == "gdr path: tcp [10.0.0.2:4791] send Pinned -> any: zero-copy (host-zero-copy)");
  int calls = 0;
  auto probed = gdr::decide_path<probing_transport, gdr::op::send, Device>(force_path::zero_copy,
                                                                           counting_probe{&calls, {}})
                    .value();
  CHECK(gdr::to_string(probed) == "gdr path: probing send Device -> any: zero-copy (gpudirect-rdma), probed, "
                                  "forced zero-copy");
  auto get = gdr::decide_path<gdr::loopback::transport, gdr::op::get, Host, Pinned>().value();
  CHECK(gdr::to_string(get) == "gdr path: loopback get Host -> Pinned: zero-copy (host-zero-copy)");
  // What a transport says of the row by message size follows it.
  auto sized = get;
  sized.sizes = "copied once";
  CHECK(gdr::to_string(sized) == "gdr path: loopback get Host -> Pinned: zero-copy (host-zero-copy); by size: copied once");
}

TEST_CASE("log_path_decision prints one line to stderr exactly when GDR_LOG asks for paths") {
  const char* spec = std::getenv("GDR_LOG");
  const bool wanted = spec != nullptr && gdr::detail::log_spec_names(spec, "path");
  MESSAGE("GDR_LOG=" << std::string(spec != nullptr ? spec : "(unset)"));
  CHECK(gdr::path_log_enabled() == wanted);
  auto d = gdr::decide_path<gdr::loopback::transport, gdr::op::recv, Host>().value();
  d.endpoint = "pair#1";
  const std::string said = capture_stderr([&] { gdr::log_path_decision(d); });
  if (wanted) {
    CHECK(said == "gdr path: loopback [pair#1] recv Host -> any: zero-copy (host-zero-copy)\n");
  } else {
    CHECK(said.empty());
  }
  // Read once: changing the environment later changes nothing.
  ::setenv("GDR_LOG", wanted ? "none" : "path", 1);
  CHECK(gdr::path_log_enabled() == wanted);
  CHECK(capture_stderr([&] { gdr::log_path_decision(d); }) == said);
  if (spec != nullptr) {
    ::setenv("GDR_LOG", spec, 1);
  } else {
    ::unsetenv("GDR_LOG");
  }
}

// A new user read `GDR_LOG=path` as "every Host message is zero-copy", while
// small messages travel eager and, on verbs, small puts and gets inside a
// SEND. Each row's line now says what happens by size, from the endpoint's
// own options: a loopback pair with a 4 KiB threshold says so.
TEST_CASE("with GDR_LOG=path, an endpoint's rows say what happens by message size under its options") {
  if (!gdr::path_log_enabled()) {
    MESSAGE("GDR_LOG does not ask for paths: path_log_test checks this");
    return;
  }
  gdr::scheduler sched;
  gdr::loopback::options o;
  o.rendezvous_threshold = 4096;
  const std::string said = capture_stderr([&] { auto pair = gdr::loopback::make_pair(sched, sched, gdr::default_registry(), o); });
  CHECK(said.find("gdr path: loopback [pair] send Host -> any: zero-copy (host-zero-copy); by size: up to 4 KiB eager, "
                  "above rendezvous") != std::string::npos);
  CHECK(said.find("recv Device -> any: staged (staged-pinned); by size: chunks of 4 MiB") != std::string::npos);
}
