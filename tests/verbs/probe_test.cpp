// gdr/transport/verbs/probe.hpp, checked against facts found independently of it: the
// kernel's sysfs (which RDMA devices exist, whether nvidia-peermem is
// loaded), libibverbs' documented errors, a fake sysfs tree, and
// capabilities built by hand.
#include <doctest/doctest.h>

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <gdr/transport/verbs/probe.hpp>

#include "tests/support/skip.hpp"

namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.insert(n);
    }
    ::closedir(d);
  }
  return names;
}

// A temporary directory tree, removed at the end.
struct temp_tree {
  std::filesystem::path root;
  temp_tree() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "gdr-probe-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    root = tmpl;
  }
  ~temp_tree() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  void mkdirs(const std::string& rel) const { std::filesystem::create_directories(root / rel); }
  void touch(const std::string& rel) const { std::ofstream(root / rel).put('1'); }
};

}  // namespace

TEST_CASE("the verbs probe runs once per process") {
  const auto& a = gdr::verbs::probe();
  const auto& b = gdr::verbs::probe();
  CHECK(&a == &b);
}

TEST_CASE("the probe lists the devices the kernel has: none without uverbs (ENOSYS), else ones sysfs names") {
  const auto& caps = gdr::verbs::probe();
  const std::set<std::string> in_sysfs = entries("/sys/class/infiniband");
  if (!is_dir("/sys/class/infiniband_verbs")) {
    // No uverbs class: the kernel has no user-space RDMA support, which
    // libibverbs reports as ENOSYS (ibv_get_device_list(3)).
    CHECK(caps.devices.empty());
    CHECK(caps.devices_error == gdr::errno_code(ENOSYS));
    CHECK(caps.why_not().find("no RDMA device") != std::string::npos);
  }
  if (caps.devices.empty()) CHECK(caps.devices_error);
  for (const auto& d : caps.devices) {
    CAPTURE(d.name);
    CHECK(in_sysfs.count(d.name) == 1);
  }
  CHECK(caps.devices.size() <= in_sysfs.size());
  MESSAGE(caps.devices.size() << " verbs device(s); /sys/class/infiniband has " << in_sysfs.size());
}

TEST_CASE("peermem is read from sysfs: the module's or nv_peer_mem's version file") {
  temp_tree sys;
  CHECK_FALSE(gdr::verbs::detail::peermem_loaded(sys.root.string()));
  sys.mkdirs("module/nvidia_peermem");
  CHECK_FALSE(gdr::verbs::detail::peermem_loaded(sys.root.string()));  // a module directory alone is not the module
  sys.touch("module/nvidia_peermem/version");
  CHECK(gdr::verbs::detail::peermem_loaded(sys.root.string()));

  temp_tree old;
  old.mkdirs("kernel/mm/memory_peers/nv_mem");
  CHECK_FALSE(gdr::verbs::detail::peermem_loaded(old.root.string()));
  old.touch("kernel/mm/memory_peers/nv_mem/version");
  CHECK(gdr::verbs::detail::peermem_loaded(old.root.string()));
}

TEST_CASE("the probe's peermem agrees with the modules this kernel has loaded") {
  // A loaded module has a directory in /sys/module; nv_peer_mem registers
  // its peer client under /sys/kernel/mm/memory_peers.
  bool loaded = is_dir("/sys/module/nvidia_peermem") || is_dir("/sys/kernel/mm/memory_peers/nv_mem");
  CHECK(gdr::verbs::probe().peermem == loaded);
}

TEST_CASE("a device's dma-buf flag is what ibv_reg_dmabuf_mr with fd -1 answers on this machine") {
  const auto& caps = gdr::verbs::probe();
  if (caps.devices.empty()) GDR_SKIP("no RDMA device here: " + caps.why_not());
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  REQUIRE(list != nullptr);
  for (int i = 0; i < n; ++i) {
    std::string name = ibv_get_device_name(list[i]);
    CAPTURE(name);
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) continue;
    ibv_pd* pd = ibv_alloc_pd(ctx);
    REQUIRE(pd != nullptr);
    errno = 0;
    ibv_mr* mr = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE);
    int err = errno;
    CHECK(mr == nullptr);  // fd -1 is never a dma-buf
    if (mr != nullptr) ibv_dereg_mr(mr);
    // EBADF: the kernel looked the fd up (dma-buf path present);
    // EOPNOTSUPP / EPROTONOSUPPORT: the provider or driver has no dma-buf.
    CHECK((err == EBADF || err == EOPNOTSUPP || err == EPROTONOSUPPORT));
    for (const auto& d : caps.devices)
      if (d.name == name) CHECK(d.dmabuf == (err == EBADF));
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
  }
  ibv_free_device_list(list);
}

TEST_CASE("gpudirect and why_not follow the capabilities they are given") {
  gdr::verbs::capabilities none;
  none.devices_error = gdr::errno_code(ENOSYS);
  none.peermem = true;  // peermem without a NIC is no GPUDirect
  CHECK_FALSE(none.gpudirect());
  CHECK(none.why_not().find("no RDMA device") != std::string::npos);
  CHECK(none.why_not().find(gdr::errno_code(ENOSYS).message()) != std::string::npos);

  gdr::verbs::capabilities plain;
  plain.devices.push_back({"rxe0", false});
  CHECK_FALSE(plain.gpudirect());
  CHECK(plain.why_not().find("nvidia-peermem is not loaded") != std::string::npos);

  gdr::verbs::capabilities peermem = plain;
  peermem.peermem = true;
  CHECK(peermem.gpudirect());
  CHECK(peermem.why_not().empty());

  gdr::verbs::capabilities dmabuf = plain;
  dmabuf.devices.push_back({"mlx5_0", true});
  CHECK(dmabuf.gpudirect());
  CHECK(dmabuf.why_not().empty());
}

TEST_CASE("require_gpudirect fails loudly with the probe's reason") {
  const auto& caps = gdr::verbs::probe();
  if (caps.gpudirect()) {
    CHECK_NOTHROW(gdr::verbs::require_gpudirect());
    return;
  }
  try {
    gdr::verbs::require_gpudirect();
    FAIL("require_gpudirect returned although the probe says no");
  } catch (const gdr::error& e) {
    CHECK(e.code() == gdr::errc::gpudirect_unavailable);
    CHECK(std::string(e.what()).find(caps.why_not()) != std::string::npos);
  }
}
