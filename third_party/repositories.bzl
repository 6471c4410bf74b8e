"""gdr_dependencies(): every external repository gdr needs, for gdr's own
WORKSPACE and for a project that uses gdr as `@gdr`:

    local_repository(name = "gdr", path = "...")
    load("@gdr//third_party:repositories.bzl", "gdr_dependencies")
    gdr_dependencies()

Nothing is downloaded. The three shims (rules_cc, rules_java,
remote_coverage_tools) stand in for repositories that Bazel 4.2.3's built-in
WORKSPACE suffix would otherwise fetch from the internet; they must be
declared before that suffix, which calling this macro from WORKSPACE does.
The system libraries are Debian packages (./bazelw installs them) and the
CUDA toolkit."""

def _vendored_repository_impl(rctx):
    # The shim's files live in gdr's tree; link them into the new repository.
    # Resolving a Label (not a path) makes this work from any workspace.
    root = rctx.path(rctx.attr.build_file_in_root).dirname
    for child in root.readdir():
        rctx.symlink(child, child.basename)

_vendored_repository = repository_rule(
    implementation = _vendored_repository_impl,
    attrs = {"build_file_in_root": attr.label(allow_single_file = True)},
)

def _showme(rctx, mpicxx, what):
    r = rctx.execute([mpicxx, "--showme:" + what])
    if r.return_code != 0:
        fail("mpicxx --showme:%s failed: %s" % (what, r.stderr))
    return [w for w in r.stdout.replace("\n", " ").split(" ") if w]

def _system_mpi_impl(rctx):
    # Ask the MPI compiler wrapper where its headers and libraries are, as
    # `mpicxx --showme:compile` / `--showme:link` would tell a Makefile.
    mpicxx = rctx.which("mpicxx")
    if not mpicxx:
        fail("mpicxx not found: install libopenmpi-dev (./bazelw does it)")

    incdirs = _showme(rctx, mpicxx, "incdirs")
    libdirs = _showme(rctx, mpicxx, "libdirs")
    includes = []
    for i, d in enumerate(incdirs):
        rctx.symlink(d, "include%d" % i)
        includes.append("include%d" % i)
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.file("BUILD.bazel", """# Generated from `mpicxx --showme` ({mpicxx}).
# Only the C API (libmpi) is linked; Open MPI's deprecated C++ bindings
# (libmpi_cxx, in --showme:link) are not used.
cc_library(
    name = "mpi",
    hdrs = glob(["include*/**/*.h"]),
    includes = {includes},  # -isystem: MPI's own warnings stay quiet
    linkopts = {linkopts},
    visibility = ["//visibility:public"],
)
""".format(
        mpicxx = mpicxx,
        includes = repr(includes),
        linkopts = repr(["-L" + d for d in libdirs] + ["-lmpi"]),
    ))

_system_mpi = repository_rule(
    implementation = _system_mpi_impl,
    environ = ["PATH"],
)

def gdr_dependencies(cuda_path = "/usr/local/cuda"):
    """Declares @rules_cc, @rules_java, @remote_coverage_tools (offline shims),
    @system_liburing, @system_ibverbs, @system_rdmacm, @system_doctest,
    @system_mpi and @local_cuda. Call it from WORKSPACE.

    Args:
      cuda_path: root of the CUDA toolkit (include/, lib64/, bin/nvcc).
    """

    # @bazel_tools//tools/cpp:BUILD loads @rules_cc//cc:defs.bzl, which the
    # built-in WORKSPACE suffix would http_archive. The suffix uses maybe(),
    # so declaring it first wins. Debian's bazel-rules-cc 0.0.4 does not work
    # with 4.2.3 (needs use_cpp_toolchain), hence a vendored shim.
    _vendored_repository(
        name = "rules_cc",
        build_file_in_root = Label("//third_party/rules_cc:BUILD.bazel"),
    )

    # Toolchain resolution parses @bazel_tools//tools/jdk, which loads
    # @rules_java//java:defs.bzl, even for C++-only builds.
    _vendored_repository(
        name = "rules_java",
        build_file_in_root = Label("//third_party/rules_java:BUILD.bazel"),
    )

    # Every *_test depends on @remote_coverage_tools (a downloaded jar). A stub
    # satisfies it; `bazel coverage` does not work.
    _vendored_repository(
        name = "remote_coverage_tools",
        build_file_in_root = Label("//third_party/remote_coverage_tools:BUILD.bazel"),
    )

    # Debian liburing-dev: /usr/include/liburing.h, liburing.so
    native.new_local_repository(
        name = "system_liburing",
        build_file = str(Label("//third_party:liburing.BUILD")),
        path = "/usr",
    )

    # Debian libibverbs-dev (rdma-core): /usr/include/infiniband/verbs.h
    native.new_local_repository(
        name = "system_ibverbs",
        build_file = str(Label("//third_party:ibverbs.BUILD")),
        path = "/usr",
    )

    # Debian librdmacm-dev (rdma-core): /usr/include/rdma/rdma_cma.h
    native.new_local_repository(
        name = "system_rdmacm",
        build_file = str(Label("//third_party:rdmacm.BUILD")),
        path = "/usr",
    )

    # Debian doctest-dev: /usr/include/doctest/doctest.h (header only)
    native.new_local_repository(
        name = "system_doctest",
        build_file = str(Label("//third_party:doctest.BUILD")),
        path = "/usr",
    )

    # Debian libopenmpi-dev, located through mpicxx --showme.
    _system_mpi(name = "system_mpi")

    # CUDA toolkit: @local_cuda//:cudart, :cuda_headers, :cuda_driver, :nvcc
    native.new_local_repository(
        name = "local_cuda",
        build_file = str(Label("//third_party:cuda.BUILD")),
        path = cuda_path,
    )
