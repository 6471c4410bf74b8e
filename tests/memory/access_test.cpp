// The access table (gdr/memory/access.hpp) pinned as compile-time facts: every
// per-space fact and every pair of spaces, Remote included. A change to the
// table must change this file too. The runtime test case only records that
// the tables compiled.
#include <doctest/doctest.h>

#include <span>
#include <type_traits>
#include <vector>

#include <gdr/memory/access.hpp>
#include <gdr/memory/remote_view.hpp>
#include <gdr/memory/space.hpp>
#include <gdr/memory/view.hpp>

namespace {

using gdr::copy_kind;
using gdr::Device;
using gdr::Host;
using gdr::Pinned;
using gdr::Remote;
using gdr::space_traits;

// ---- spaces are tags that name themselves --------------------------------
static_assert(gdr::memory_space<Host> && gdr::memory_space<Pinned> && gdr::memory_space<Device>);
static_assert(gdr::memory_space<Remote<Host>> && gdr::memory_space<Remote<Pinned>> && gdr::memory_space<Remote<Device>>);
static_assert(!gdr::memory_space<int> && !gdr::memory_space<void>);
static_assert(gdr::local_memory_space<Host> && gdr::local_memory_space<Pinned> && gdr::local_memory_space<Device>);
static_assert(!gdr::local_memory_space<Remote<Host>> && !gdr::local_memory_space<Remote<Device>>);
static_assert(!gdr::is_remote_v<Host> && !gdr::is_remote_v<Pinned> && !gdr::is_remote_v<Device>);
static_assert(gdr::is_remote_v<Remote<Host>> && gdr::is_remote_v<Remote<Pinned>> && gdr::is_remote_v<Remote<Device>>);
static_assert(std::is_same_v<Remote<Device>::peer_space, Device>);

// ---- per-space facts ------------------------------------------------------
//                     host_accessible  copy_engine  page_locked  on_device
template <class S, bool H, bool C, bool L, bool D>
constexpr bool facts = space_traits<S>::host_accessible == H && space_traits<S>::copy_engine_accessible == C &&
                       space_traits<S>::page_locked == L && space_traits<S>::on_device == D;
static_assert(facts<Host, /**/ true, /**/ false, /**/ false, /**/ false>);
static_assert(facts<Pinned, /**/ true, /**/ true, /**/ true, /**/ false>);
static_assert(facts<Device, /**/ false, /**/ true, /**/ true, /**/ true>);
static_assert(facts<Remote<Host>, false, false, false, false>);
static_assert(facts<Remote<Pinned>, false, false, false, false>);
static_assert(facts<Remote<Device>, false, false, false, false>);
// The conservative default applies to anything not in the table.
static_assert(facts<int, false, false, false, false>);

static_assert(gdr::host_accessible<Host> && gdr::host_accessible<Pinned>);
static_assert(!gdr::host_accessible<Device> && !gdr::host_accessible<Remote<Host>> && !gdr::host_accessible<Remote<Pinned>>);

// ---- copy paths: every (Dst, Src) pair of the six spaces -----------------
template <class Dst, class Src, copy_kind K, class Via = void>
constexpr bool path = gdr::copy_path<Dst, Src>::kind == K && std::is_same_v<typename gdr::copy_path<Dst, Src>::via, Via>;

//              Dst      Src                                     via
static_assert(path<Host, Host, copy_kind::host_memcpy>);
static_assert(path<Host, Pinned, copy_kind::host_memcpy>);
static_assert(path<Host, Device, copy_kind::none, Pinned>);
static_assert(path<Pinned, Host, copy_kind::host_memcpy>);
static_assert(path<Pinned, Pinned, copy_kind::host_memcpy>);
static_assert(path<Pinned, Device, copy_kind::device_to_host>);
static_assert(path<Device, Host, copy_kind::none, Pinned>);
static_assert(path<Device, Pinned, copy_kind::host_to_device>);
static_assert(path<Device, Device, copy_kind::device_to_device>);

// Remote is reached only through a transport: no local path, no intermediate,
// in either direction and between Remote spaces.
template <class L>
constexpr bool no_path_with_remote =
    path<L, Remote<Host>, copy_kind::none> && path<L, Remote<Pinned>, copy_kind::none> &&
    path<L, Remote<Device>, copy_kind::none> && path<Remote<Host>, L, copy_kind::none> &&
    path<Remote<Pinned>, L, copy_kind::none> && path<Remote<Device>, L, copy_kind::none>;
static_assert(no_path_with_remote<Host> && no_path_with_remote<Pinned> && no_path_with_remote<Device>);
static_assert(no_path_with_remote<Remote<Host>> && no_path_with_remote<Remote<Pinned>> &&
              no_path_with_remote<Remote<Device>>);

// copyable_to and copy_uses_engine_v agree with the kinds above.
static_assert(gdr::copyable_to<Host, Pinned> && gdr::copyable_to<Device, Pinned> && gdr::copyable_to<Pinned, Device>);
static_assert(!gdr::copyable_to<Device, Host> && !gdr::copyable_to<Host, Device> && !gdr::copyable_to<Host, Remote<Host>>);
static_assert(gdr::copy_uses_engine_v<Device, Pinned> && gdr::copy_uses_engine_v<Pinned, Device> &&
              gdr::copy_uses_engine_v<Device, Device>);
static_assert(!gdr::copy_uses_engine_v<Host, Host> && !gdr::copy_uses_engine_v<Pinned, Host> &&
              !gdr::copy_uses_engine_v<Host, Pinned> && !gdr::copy_uses_engine_v<Pinned, Pinned> &&
              !gdr::copy_uses_engine_v<Device, Host>);

// Every engine path has both ends copy-engine accessible; every CPU path has
// both ends host accessible. (The table is coherent with the space facts.)
template <class Dst, class Src>
constexpr bool coherent =
    (!gdr::copy_uses_engine_v<Dst, Src> ||
     (space_traits<Dst>::copy_engine_accessible && space_traits<Src>::copy_engine_accessible)) &&
    (gdr::copy_path<Dst, Src>::kind != copy_kind::host_memcpy ||
     (space_traits<Dst>::host_accessible && space_traits<Src>::host_accessible));
template <class Dst>
constexpr bool coherent_row = coherent<Dst, Host> && coherent<Dst, Pinned> && coherent<Dst, Device>;
static_assert(coherent_row<Host> && coherent_row<Pinned> && coherent_row<Device>);

// ---- what the view allows, where the rule is a constraint ------------------
// (Element access on Device views is a static_assert with a message, so it is
// pinned by the compile-fail tests in tests/type_safety instead.)
static_assert(std::is_constructible_v<gdr::view<int, Host>, std::vector<int>&>);
static_assert(std::is_constructible_v<gdr::view<int, Pinned>, std::span<int>>);
static_assert(!std::is_constructible_v<gdr::view<int, Device>, std::vector<int>&>);
static_assert(!std::is_constructible_v<gdr::view<int, Device>, std::span<int>>);
static_assert(std::is_convertible_v<gdr::view<int, Device>, gdr::view<const int, Device>>);
static_assert(!std::is_convertible_v<gdr::view<const int, Host>, gdr::view<int, Host>>);
static_assert(!std::is_convertible_v<gdr::view<int, Host>, gdr::view<int, Pinned>>);
static_assert(!std::is_convertible_v<gdr::view<int, Pinned>, gdr::view<int, Device>>);
static_assert(std::is_same_v<gdr::remote_view<int, Device>::space, Remote<Device>>);

// A view is a pointer, a size and an ordinal: cheap to pass by value.
static_assert(std::is_trivially_copyable_v<gdr::view<int, Device>>);
static_assert(sizeof(gdr::view<int, Host>) <= 3 * sizeof(void*));

}  // namespace

TEST_CASE("the access table's compile-time facts hold") {
  // Everything above is a static_assert: reaching this line is the test.
  CHECK(gdr::copy_path<Device, Host>::kind == copy_kind::none);
}
