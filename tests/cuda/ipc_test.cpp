// gdr/cuda/ipc.hpp and the CUDA IPC members of the event poller
// (gdr/cuda/event_poller_ipc.hpp): what a peer's descriptor can make this
// GPU read, the stream order of an importing copy, and what an export of a
// gdr::buffer shares.
//
// The bounds arithmetic runs anywhere (fake numbers). The rest needs a GPU:
// a descriptor of this process's own memory, and a legacy handle of a
// child process's cudaMalloc memory (this binary spawned again: the test
// case "ipc test peer", skipped unless a parent selects it), each with a
// claimed size larger than the allocation and a range past it, which the
// copy refuses with errc::protocol_error, queueing nothing; a copy ordered
// after a user's stream; and the extent of small Device buffers.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <string>
#include <system_error>
#include <vector>

#include <gdr/cuda/event_poller.hpp>
#include <gdr/cuda/ipc.hpp>
#include <gdr/cuda/stream.hpp>
#include <gdr/cuda/vmm.hpp>
#include <gdr/memory/buffer.hpp>
#include <gdr/sched/copy_engine.hpp>
#include <gdr/sched/scheduler.hpp>

#include "tests/cuda/cuda_test_support.hpp"
#include "tests/support/skip.hpp"

extern char** environ;

using gdr::cuda::ipc_extent;
using gdr::cuda::ipc_within;
using ipc_memory = gdr::copy_engine::ipc_memory;

namespace {

constexpr std::uint64_t max64 = ~std::uint64_t{0};

// Counts a copy's completions.
struct probe : gdr::copy_engine::completion {
  int calls = 0;
  std::error_code ec;
  probe() {
    done = [](gdr::copy_engine::completion* c, std::error_code ec) noexcept {
      auto* self = static_cast<probe*>(c);
      ++self->calls;
      self->ec = ec;
    };
  }
};

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed * 7 + 1) & 0xff);
  return v;
}

std::vector<unsigned char> read_back(const void* p, std::size_t n) {
  std::vector<unsigned char> v(n);
  REQUIRE(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost) == cudaSuccess);
  return v;
}

/// The driver's range of the allocation holding `p`.
std::pair<std::uintptr_t, std::size_t> range_of(const void* p) {
  const auto& q = gdr::cuda::detail::address_range::get();
  REQUIRE(static_cast<bool>(q.fn));
  CUdeviceptr base = 0;
  std::size_t size = 0;
  REQUIRE(q.fn(&base, &size, reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS);
  return {static_cast<std::uintptr_t>(base), size};
}

}  // namespace

TEST_CASE("a copy may read only what the driver's range holds from the import, never more than the claim") {
  // The range holds the import whole: the claim bounds it.
  CHECK(ipc_extent(0x10000, 0x10000, 4096, 4096) == 4096);
  CHECK(ipc_extent(0x10000, 0x10000, 4096, 100) == 100);
  // A claim larger than the allocation: what the allocation holds.
  CHECK(ipc_extent(0x10000, 0x10000, 4096, 1 << 30) == 4096);
  CHECK(ipc_extent(0x10000, 0x10000, 4096, max64) == 4096);
  // The import starts inside a larger range (a block the driver mapped whole).
  CHECK(ipc_extent(0x10000 + 512, 0x10000, 2 << 20, max64) == (2u << 20) - 512);
  CHECK(ipc_extent(0x10000 + 512, 0x10000, 2 << 20, 512) == 512);
  // Outside the range: nothing.
  CHECK(ipc_extent(0x10000 + 4096, 0x10000, 4096, 4096) == 0);
  CHECK(ipc_extent(0xffff, 0x10000, 4096, 4096) == 0);
  CHECK(ipc_extent(0x10000, 0x10000, 0, 4096) == 0);
  CHECK(ipc_extent(max64, max64 - 1, 2, max64) == 1);
  CHECK(ipc_extent(0, max64, max64, max64) == 0);

  CHECK(ipc_within(0, 4096, 4096));
  CHECK(ipc_within(4095, 1, 4096));
  CHECK(ipc_within(4096, 0, 4096));
  CHECK(!ipc_within(4096, 1, 4096));
  CHECK(!ipc_within(1, 4096, 4096));
  CHECK(!ipc_within(0, 4097, 4096));
  // No wrap-around, whatever the peer sends.
  CHECK(!ipc_within(max64, 2, 4096));
  CHECK(!ipc_within(2, max64, 4096));
  CHECK(!ipc_within(max64, max64, max64 - 1));
  CHECK(ipc_within(max64 - 1, 1, max64));
  // The descriptor: a claim larger than the allocation and a
  // range past its end passes a check against the claim, not against
  // the extent.
  const std::uint64_t real = 2u << 20, claim = 64u << 20, off = real + 4096, n = 4096;
  CHECK(ipc_within(off, n, claim));
  CHECK(!ipc_within(off, n, ipc_extent(0x7f0000000000, 0x7f0000000000, real, claim)));
}

TEST_CASE("a copy out of this process's own allocation past what it holds is refused with protocol_error, whatever the descriptor claims") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller ev(sched);
  if (!ev.ipc_capable()) GDR_SKIP("this GPU and driver cannot share device memory by CUDA IPC");
  constexpr std::size_t n = std::size_t{2} << 20;
  void* src = nullptr;
  REQUIRE(cudaMalloc(&src, n) == cudaSuccess);
  const auto want = pattern(n, 1);
  REQUIRE(cudaMemcpy(src, want.data(), n, cudaMemcpyHostToDevice) == cudaSuccess);
  gdr::buffer<unsigned char, gdr::Device> dst(4096);
  REQUIRE(cudaMemset(dst.data(), 0, 4096) == cudaSuccess);
  ipc_memory m;
  std::uint64_t off = 0;
  const char* why = nullptr;
  REQUIRE_FALSE(ev.ipc_export(src, n, m, off, &why));
  CHECK(m.kind == gdr::copy_engine::ipc_kind::handle);
  CHECK(off == 0);
  CHECK(m.size >= n);
  ipc_memory forged = m;
  forged.size = m.size * 16;
  probe p;
  CHECK(ev.ipc_copy(forged, m.size + 4096, dst.data(), 0, 4096, {}, &p) == gdr::errc::protocol_error);
  CHECK(ev.ipc_copy(forged, m.size - 100, dst.data(), 0, 4096, {}, &p) == gdr::errc::protocol_error);
  CHECK(ev.pending() == 0);
  CHECK(p.calls == 0);
  CHECK(read_back(dst.data(), 4096) == std::vector<unsigned char>(4096, 0));
  // Inside the allocation: copied, under the same forged claim.
  REQUIRE_FALSE(ev.ipc_copy(forged, 8192, dst.data(), 0, 4096, {}, &p));
  while (p.calls == 0) sched.run_once();
  CHECK_FALSE(p.ec);
  CHECK(read_back(dst.data(), 4096) == std::vector<unsigned char>(want.begin() + 8192, want.begin() + 8192 + 4096));
  REQUIRE(cudaFree(src) == cudaSuccess);
}

// ------------------------------------------------------------------ a peer's legacy handle

TEST_CASE("ipc test peer (a child's cudaMalloc memory, exported; runs only when a parent spawns it)" * doctest::skip()) {
  const char* out = std::getenv("GDR_IPC_TEST_OUT");
  const char* in = std::getenv("GDR_IPC_TEST_IN");
  REQUIRE(out != nullptr);
  REQUIRE(in != nullptr);
  const int out_fd = std::atoi(out), in_fd = std::atoi(in);
  bool ok = false;
  {
    gdr::scheduler s;
    gdr::cuda::event_poller ev(s);
    constexpr std::size_t n = std::size_t{2} << 20;
    void* p = nullptr;
    if (cudaMalloc(&p, n) == cudaSuccess) {
      const auto v = pattern(n, 2);
      ipc_memory m;
      std::uint64_t off = 0;
      const char* why = nullptr;
      if (cudaMemcpy(p, v.data(), n, cudaMemcpyHostToDevice) == cudaSuccess && !ev.ipc_export(p, n, m, off, &why)) {
        std::byte rec[ipc_memory::wire_size];
        m.to_wire(rec);
        ok = ::write(out_fd, rec, sizeof rec) == static_cast<ssize_t>(sizeof rec);
        // Until the parent is done with it (its end closed).
        char c;
        while (::read(in_fd, &c, 1) > 0) {
        }
      }
      (void)cudaFree(p);
    }
  }
  std::fflush(nullptr);
  ::_exit(ok ? 0 : 1);
}

namespace {

/// A child that exports 2 MiB of cudaMalloc memory by legacy handle and
/// keeps it until `finish()` (or destruction).
struct handle_peer {
  pid_t pid = -1;
  int from_child = -1, to_child = -1;

  handle_peer() {
    int up[2], down[2];
    REQUIRE(::pipe2(up, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(down, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t fa;
    ::posix_spawn_file_actions_init(&fa);
    ::posix_spawn_file_actions_adddup2(&fa, up[1], 100);
    ::posix_spawn_file_actions_adddup2(&fa, down[0], 101);
    std::string exe = "/proc/self/exe";
    std::vector<std::string> args = {exe, "--no-skip", "--test-case=ipc test peer*", "--no-intro", "--no-version"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env = {"GDR_IPC_TEST_OUT=100", "GDR_IPC_TEST_IN=101"};
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const int rc = ::posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), envp.data());
    ::posix_spawn_file_actions_destroy(&fa);
    ::close(up[1]);
    ::close(down[0]);
    from_child = up[0];
    to_child = down[1];
    REQUIRE(rc == 0);
  }
  handle_peer(const handle_peer&) = delete;
  handle_peer& operator=(const handle_peer&) = delete;
  ~handle_peer() { (void)finish(); }

  /// The child's descriptor (waits up to 60 s).
  ipc_memory descriptor() {
    std::byte rec[ipc_memory::wire_size];
    std::size_t got = 0;
    while (got < sizeof rec) {
      pollfd pfd{from_child, POLLIN, 0};
      REQUIRE(::poll(&pfd, 1, 60000) == 1);
      const ssize_t r = ::read(from_child, rec + got, sizeof rec - got);
      REQUIRE(r > 0);
      got += static_cast<std::size_t>(r);
    }
    ipc_memory m = ipc_memory::from_wire(rec);
    m.kind = gdr::copy_engine::ipc_kind::handle;
    m.fd = -1;
    return m;
  }

  /// Lets the child go; its exit status (0: it exported and waited).
  int finish() {
    if (pid < 0) return -1;
    ::close(to_child);
    ::close(from_child);
    int st = 0;
    ::waitpid(pid, &st, 0);
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
};

}  // namespace

TEST_CASE("a peer's legacy handle that claims more than its allocation: a copy past the allocation is refused with protocol_error, one inside it reads the peer's bytes") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller ev(sched);
  if (!ev.ipc_capable()) GDR_SKIP("this GPU and driver cannot share device memory by CUDA IPC");
  constexpr std::size_t n = std::size_t{2} << 20, k = 4096;
  handle_peer peer;
  const ipc_memory m = peer.descriptor();
  REQUIRE(m.pid == peer.pid);
  CHECK(m.size >= n);
  gdr::buffer<unsigned char, gdr::Device> dst(k);
  REQUIRE(cudaMemset(dst.data(), 0, k) == cudaSuccess);
  const auto want = pattern(n, 2);
  // The descriptor: 64 times the allocation claimed, the range
  // past its end. The handle opens (the driver opens what was allocated),
  // and nothing is queued: the GPU never reads past the mapping.
  ipc_memory forged = m;
  forged.size = m.size * 64;
  probe p;
  CHECK(ev.ipc_copy(forged, m.size + k, dst.data(), 0, k, {}, &p) == gdr::errc::protocol_error);
  CHECK(ev.ipc_copy(forged, m.size * 32, dst.data(), 0, k, {}, &p) == gdr::errc::protocol_error);
  CHECK(ev.pending() == 0);
  CHECK(p.calls == 0);
  CHECK(ev.ipc().stats().imports == 1);
  CHECK(read_back(dst.data(), k) == std::vector<unsigned char>(k, 0));
  // The last bytes of the allocation, under the forged claim: copied.
  REQUIRE_FALSE(ev.ipc_copy(forged, n - k, dst.data(), 0, k, {}, &p));
  while (p.calls == 0) sched.run_once();
  CHECK_FALSE(p.ec);
  CHECK(read_back(dst.data(), k) == std::vector<unsigned char>(want.end() - k, want.end()));
  // The honest descriptor: the same bytes (its import replaces the one
  // made under the other claim).
  REQUIRE(cudaMemset(dst.data(), 0, k) == cudaSuccess);
  probe q;
  REQUIRE_FALSE(ev.ipc_copy(m, 0, dst.data(), 0, k, {}, &q));
  while (q.calls == 0) sched.run_once();
  CHECK_FALSE(q.ec);
  CHECK(read_back(dst.data(), k) == std::vector<unsigned char>(want.begin(), want.begin() + k));
  CHECK(ev.ipc_copy(m, n, dst.data(), 0, 1, {}, &q) == gdr::errc::invalid_argument);  // past the claim
  ev.ipc_forget(peer.pid);
  CHECK(ev.ipc().size() == 0);
  CHECK(peer.finish() == 0);
}

// ------------------------------------------------------------------ stream order

TEST_CASE("a CUDA IPC copy with `after` waits for the user's stream: a memset queued there before it cannot overwrite it") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched({.mode = gdr::run_mode::busy_poll});
  gdr::cuda::event_poller ev(sched);
  if (!ev.ipc_capable()) GDR_SKIP("this GPU and driver cannot share device memory by CUDA IPC");
  gdr::cuda::stream user(0);
  gdr_test::busy_work work;
  constexpr std::size_t n = std::size_t{4} << 20;
  gdr::buffer<unsigned char, gdr::Device> src(n), dst(n);
  const auto want = pattern(n, 3);
  REQUIRE(cudaMemcpy(src.data(), want.data(), n, cudaMemcpyHostToDevice) == cudaSuccess);
  ipc_memory m;
  std::uint64_t off = 0;
  const char* why = nullptr;
  REQUIRE_FALSE(ev.ipc_export(src.data(), n, m, off, &why));
  // The copy's destination is still being written on the user's stream
  // (about 4 ms of copies, then a memset of it): the copy must come after.
  auto run = [&](bool ordered) {
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    work.queue(user, 16);
    REQUIRE(cudaMemsetAsync(dst.data(), 0x11, n, user.get()) == cudaSuccess);
    probe p;
    const gdr::stream_order after = ordered ? gdr::cuda::after(user) : gdr::stream_order{};
    REQUIRE_FALSE(ev.ipc_copy(m, off, dst.data(), 0, n, after, &p));
    if (ordered) CHECK_FALSE(user.query().value());  // queued while the user's work runs
    while (p.calls == 0) sched.run_once();
    CHECK_FALSE(p.ec);
    if (ordered) CHECK(user.query().value());  // completed only after it
    REQUIRE(cudaStreamSynchronize(user.get()) == cudaSuccess);
    const auto got = read_back(dst.data(), n);
    return static_cast<std::size_t>(std::mismatch(got.begin(), got.end(), want.begin()).first - got.begin());
  };
  const std::size_t unordered = run(false);
  MESSAGE("without `after`, the copy's bytes survived up to " << unordered << " of " << n);
  CHECK(run(true) == n);
}

// ------------------------------------------------------------------ what an export of a gdr::buffer shares

TEST_CASE("a small Device buffer is an allocation of its own: its export shares it and zeros, nothing beside it") {
  if (std::string why = gdr_test::no_gpu_reason(); !why.empty()) GDR_SKIP(why);
  gdr::scheduler sched;
  gdr::cuda::event_poller ev(sched);
  if (!ev.ipc_capable()) GDR_SKIP("this GPU and driver cannot share device memory by CUDA IPC");
  gdr::cuda::set_device_allocation({});  // automatic: below 1 MiB, cudaMalloc
  gdr::buffer<unsigned char, gdr::Device> a(100), b(100), c(5000);
  CHECK(a.method() == gdr::alloc_method::cuda_malloc);
  for (auto* buf : {&a, &b, &c}) {
    CAPTURE(buf->size());
    const auto [base, size] = range_of(buf->data());
    CHECK(base == reinterpret_cast<std::uintptr_t>(buf->data()));
    CHECK(size == gdr::cuda::ipc_block);
    // Its export names exactly that, and its padding is zeros.
    ipc_memory m;
    std::uint64_t off = 0;
    const char* why = nullptr;
    REQUIRE_FALSE(ev.ipc_export(buf->data() + 10, 50, m, off, &why));
    CHECK(m.kind == gdr::copy_engine::ipc_kind::handle);
    CHECK(m.base == base);
    CHECK(m.size == gdr::cuda::ipc_block);
    CHECK(off == 10);
    const auto tail = read_back(buf->data() + buf->size(), gdr::cuda::ipc_block - buf->size());
    CHECK(std::all_of(tail.begin(), tail.end(), [](unsigned char x) { return x == 0; }));
  }
  // None reaches another.
  const auto [abase, asize] = range_of(a.data());
  for (const void* other : {static_cast<const void*>(b.data()), static_cast<const void*>(c.data())}) {
    const auto at = reinterpret_cast<std::uintptr_t>(other);
    CHECK((at < abase || at >= abase + asize));
  }
  // A buffer of the virtual memory API: rounded to the granularity, the
  // padding zeros too.
  if (gdr::cuda::vmm_shareable(0)) {
    gdr::buffer<unsigned char, gdr::Device> big((3u << 20) + 5);
    CHECK(big.method() == gdr::alloc_method::cuda_vmm);
    gdr::cuda::vmm_block blk;
    std::error_code ec;
    REQUIRE(gdr::cuda::vmm_registry::instance().find_exported(big.data(), big.size(), blk, ec));
    REQUIRE(!ec);
    REQUIRE(blk.size > big.size());
    const auto tail = read_back(big.data() + big.size(), blk.size - big.size());
    CHECK(std::all_of(tail.begin(), tail.end(), [](unsigned char x) { return x == 0; }));
  }
  // Opting out: the driver may pack small buffers (this only says what it did).
  gdr::cuda::set_device_allocation({.exclusive_blocks = false});
  {
    gdr::buffer<unsigned char, gdr::Device> packed(100);
    const auto [base, size] = range_of(packed.data());
    MESSAGE("with exclusive_blocks off, a 100-byte buffer's range is " << size << " bytes at offset "
                                                                       << reinterpret_cast<std::uintptr_t>(packed.data()) - base);
  }
  gdr::cuda::set_device_allocation({});
  CHECK(gdr::cuda::current_device_allocation().exclusive_blocks);
}
