"""header_check_srcs: one generated .cpp per header, each including only that
header, so that a cc target built from them proves every public header
compiles on its own (the `checkheaders` idea: a header must include what it
uses, not rely on what its includer happened to include first)."""

def _impl(ctx):
    outs = []
    for h in ctx.files.hdrs:
        src = ctx.actions.declare_file("%s/%s.cpp" % (ctx.label.name, h.short_path))
        ctx.actions.write(src, "#include <%s>  // and nothing else\n" % h.short_path)
        outs.append(src)
    return [DefaultInfo(files = depset(outs))]

header_check_srcs = rule(
    implementation = _impl,
    attrs = {"hdrs": attr.label_list(allow_files = [".hpp", ".h"])},
)
