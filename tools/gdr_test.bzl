"""Macros for gdr's own tests, examples and benchmarks: the native cc rules
plus gdr's warning flags.

The flags are per target (not a global --copt) because system and
third-party headers compiled as part of a target may warn. gdr's headers are
included with -I (not -isystem), so their warnings show here too.
-Wundef catches a misspelt 0/1 config macro (`#if GDR_HAS_CUDA`)."""

GDR_WARNINGS = [
    "-Wall",
    "-Wextra",
    "-Wundef",
]

def gdr_copts():
    """gdr's warning flags, with -Werror unless --define=gdr_werror=0."""
    return GDR_WARNINGS + select({
        str(Label("//tools:no_werror")): [],
        "//conditions:default": ["-Werror"],
    })

_DOCTEST = [
    str(Label("//tests/support:doctest_main")),
    str(Label("//tests/support:skip")),
    str(Label("//tests/support:watchdog")),
    str(Label("//tests/support:capture_stderr")),
    str(Label("@system_doctest//:doctest")),
]

def gdr_test(name, srcs, deps = [], size = "small", tags = [], data = [], env = {}, copts = [], **kwargs):
    """A doctest cc_test: links doctest's main; "tests/support/skip.hpp"
    (GDR_SKIP), "tests/support/watchdog.hpp" and
    "tests/support/capture_stderr.hpp" are available.

    Tag tests that need hardware or run long, so they can be filtered with
    --test_tag_filters: "gpu", "rdma", "multi_gpu", "long". Tag "threads" a
    test that starts a thread (or whose helper does): --config=tsan runs
    only those (gdr starts no thread of its own; a data race needs two), and
    .ci/run checks that none is missing (.ci/sanitizer-scope.sh). Tag
    "hardware_only" a test whose every case needs a GPU or an RDMA device:
    here it only skips, and the sanitizer configs leave it out (the same
    script checks, against the default config's logs, that it ran no case).
    """
    native.cc_test(
        name = name,
        srcs = srcs,
        deps = deps + _DOCTEST,
        size = size,
        tags = tags,
        data = data,
        env = env,
        copts = gdr_copts() + copts,
        **kwargs
    )

def gdr_tests(srcs, hdrs = [], deps = [], threaded = [], hardware_only = [], tags = [], **kwargs):
    """One gdr_test per source file, named after its package-relative path
    without the extension: `loopback/endpoint_test.cpp` gives
    `:loopback/endpoint_test`. Used with glob(["**/*_test.cpp"]) so new tests
    are picked up; `hdrs` are helper headers any of them may include (as
    "tests/<area>/..."). Declare a test by hand (and exclude it from the
    glob) when it needs its own tags, size or data. `threaded`: the sources
    among `srcs` that start threads (tagged "threads"); `hardware_only`:
    those whose every case needs a GPU or an RDMA device (tagged
    "hardware_only")."""
    for src in srcs:
        gdr_test(
            name = src.rsplit(".", 1)[0],
            srcs = [src] + hdrs,
            deps = deps,
            tags = tags + (["threads"] if src in threaded else []) +
                   (["hardware_only"] if src in hardware_only else []),
            **kwargs
        )

def gdr_cc_binary(name, copts = [], **kwargs):
    """cc_binary with gdr's warning flags (examples, benchmarks, tools)."""
    native.cc_binary(name = name, copts = gdr_copts() + copts, **kwargs)

def gdr_cc_library(name, copts = [], **kwargs):
    """cc_library with gdr's warning flags (test and benchmark helpers)."""
    native.cc_library(name = name, copts = gdr_copts() + copts, **kwargs)
