"""include_root: puts the root of the repository that defines it on the
include path with -I, so that a header at gdr/error.hpp is reached as
<gdr/error.hpp>, with angle brackets, and warns like user code.

Why not cc_library's include_prefix/strip_include_prefix: any combination
that maps gdr/error.hpp to gdr/error.hpp leaves Bazel 4.2.3 with nothing to
do. It adds -I bazel-out/.../_virtual_includes/<name> but creates no
symlinks there, since the path is unchanged, so only "gdr/error.hpp" (quotes,
via -iquote) compiles. And `includes` gives -isystem, which hides warnings.

The directory is "." in gdr's own workspace and "external/gdr" where gdr is
an external repository. Headers must still be listed in a cc_library's hdrs
(that is what puts them in the sandbox and tracks them)."""

def _include_root_impl(ctx):
    root = ctx.label.workspace_root or "."
    return [CcInfo(compilation_context = cc_common.create_compilation_context(
        includes = depset([root]),
    ))]

include_root = rule(
    implementation = _include_root_impl,
    doc = "CcInfo that adds -I<root of this repository>; use it in deps.",
)
