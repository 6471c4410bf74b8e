#!/usr/bin/env python3
"""Compiles every C++ snippet of a Markdown guide (docs/GUIDE.md).

    extract_snippets.py GUIDE.md --root ROOT --out DIR [--list] [--jobs N]

ROOT is the directory that holds gdr/ (it goes on the include path as -I).
Each snippet becomes DIR/snippet_<line>.cpp and is compiled on its own with
`g++ -std=c++20 -Wall -Wextra -Wundef -Werror -fsyntax-only`, and again with
clang++ where it is installed. `--list` only writes the files and lists them.
Exit status: 0 when every snippet behaved as its directives say, 1 otherwise
(also when the guide has no snippet at all, or a directive is unknown).

The convention
==============
Every fenced block opened with ```cpp is a snippet (other fences, ``` alone,
```sh, ```text, are prose and ignored). A snippet is one translation unit:

  * no directive: a complete program or file, compiled as it stands;
  * directives are comment lines at the top of the block, one or more:

      // guide: fragment        namespace-scope code (functions, coroutines,
                                types) without #includes: compiled after the
                                prelude below;
      // guide: body            statements, wrapped in the prelude and
                                  gdr::task<> guide_body(gdr::scheduler& sched,
                                                         gdr::tcp::endpoint& ep) {
                                    <the snippet>
                                    co_return;
                                  }
                                (both parameters are [[maybe_unused]]);
      // guide: cuda            needs the CUDA headers: compiled with
                                -DGDR_HAS_CUDA=1 -isystem $CUDA_HOME/include
                                (default /usr/local/cuda); skipped with a
                                `[gdr-skip]` line where they are missing;
      // guide: error REGEX     must NOT compile, and the compiler's output
                                must match REGEX (Python `re.search`) under
                                every compiler: a mistake the guide shows;
      // guide: skip REASON     not compiled; prints `[gdr-skip] ... REASON`.

    `fragment` or `body` combine with `cuda` and `error`
    (`// guide: fragment cuda`, or one directive per line).

The prelude is `#include <gdr/gdr.hpp>`, the standard headers in PRELUDE
below, and `using namespace std::chrono_literals;`. A `#line` directive
before the snippet makes diagnostics name GUIDE.md and its line numbers.
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

PRELUDE = """\
#include <gdr/gdr.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <span>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
"""

FLAGS = ["-std=c++20", "-Wall", "-Wextra", "-Wundef", "-Werror", "-fsyntax-only",
         "-fdiagnostics-color=never"]

DIRECTIVE = re.compile(r"^\s*//\s*guide:\s*(.*?)\s*$")
WORDS = {"fragment", "body", "cuda", "error", "skip"}


class Snippet:
    def __init__(self, line, lines):
        self.line = line          # line of the first code line in the guide
        self.code = lines         # the block's lines, directives included
        self.fragment = False
        self.body = False
        self.cuda = False
        self.error = None         # regex the diagnostics must match
        self.skip = None          # reason
        self.problems = []

    @property
    def name(self):
        return "snippet_%04d" % self.line

    def kind(self):
        k = "body" if self.body else "fragment" if self.fragment else "program"
        if self.cuda:
            k += ", cuda"
        if self.error is not None:
            k += ", must not compile"
        return k


def parse(path):
    """The guide's ```cpp blocks, with their directives."""
    snippets, problems = [], []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*(\S*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        start = i + 1
        j = start
        while j < len(lines) and not re.match(r"^\s*" + re.escape(fence) + r"\s*$", lines[j]):
            j += 1
        if j == len(lines):
            problems.append("%s:%d: a code block is never closed" % (path, i + 1))
            break
        if lang.lower() in ("cpp", "c++"):
            body = [l[len(indent):] if l.startswith(indent) else l for l in lines[start:j]]
            snippets.append(Snippet(start + 1, body))
        i = j + 1
    for s in snippets:
        read_directives(s, path)
    return snippets, problems


def read_directives(s, path):
    for text in s.code:
        if not text.strip():
            continue
        m = DIRECTIVE.match(text)
        if not m:
            break  # directives come first
        rest = m.group(1)
        while rest:
            word, _, tail = rest.partition(" ")
            tail = tail.strip()
            if word == "error":
                s.error = tail
                if not tail:
                    s.problems.append("`error` needs a regular expression")
                else:
                    try:
                        re.compile(tail)
                    except re.error as e:
                        s.problems.append("bad `error` expression %r: %s" % (tail, e))
                rest = ""
            elif word == "skip":
                s.skip = tail or "no reason given"
                rest = ""
            elif word in WORDS:
                setattr(s, word, True)
                rest = tail
            else:
                s.problems.append("unknown directive %r (known: %s)" % (word, ", ".join(sorted(WORDS))))
                rest = ""
    if s.fragment and s.body:
        s.problems.append("`fragment` and `body` exclude each other")
    for p in s.problems:
        print("%s:%d: %s" % (path, s.line, p))


def source_of(s, guide_name):
    out = []
    if s.fragment or s.body:
        out.append(PRELUDE)
    if s.body:
        out.append("gdr::task<> guide_body([[maybe_unused]] gdr::scheduler& sched,\n"
                   "                       [[maybe_unused]] gdr::tcp::endpoint& ep) {\n")
    out.append('#line %d "%s"\n' % (s.line, guide_name))
    out.append("\n".join(s.code) + "\n")
    if s.body:
        out.append("co_return;\n}\n")
    return "".join(out)


def compile_one(compiler, src, root, cuda_include, s):
    cmd = [compiler] + FLAGS + ["-I", root]
    if s.cuda:
        cmd += ["-DGDR_HAS_CUDA=1", "-isystem", cuda_include]
    cmd.append(src)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, p.stdout


def judge(s, compiler, rc, output):
    """(ok, why) for one compile of snippet s."""
    if s.error is None:
        return rc == 0, "does not compile"
    if rc == 0:
        return False, "compiles, but the guide says it must not"
    if not re.search(s.error, output):
        return False, "fails to compile, but its diagnostics do not match %r" % s.error
    return True, ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("guide")
    ap.add_argument("--root", required=True, help="the directory that holds gdr/")
    ap.add_argument("--out", required=True, help="where the snippets are written")
    ap.add_argument("--list", action="store_true", help="only write and list the snippets")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    guide_name = os.path.relpath(args.guide, args.root) if args.root else args.guide
    snippets, problems = parse(args.guide)
    for p in problems:
        print(p)
    bad = bool(problems) or any(s.problems for s in snippets)
    if not snippets:
        print("%s: no ```cpp block found: nothing was checked" % args.guide)
        return 1

    os.makedirs(args.out, exist_ok=True)
    for s in snippets:
        s.path = os.path.join(args.out, s.name + ".cpp")
        with open(s.path, "w", encoding="utf-8") as f:
            f.write(source_of(s, guide_name))
    if args.list:
        for s in snippets:
            print("%s  %s:%d  (%s)" % (s.path, guide_name, s.line, s.kind()))
        return 1 if bad else 0

    compilers = [c for c in ("g++", "clang++") if shutil.which(c)]
    if "g++" not in compilers:
        print("g++ not found: the guide's snippets are checked with g++ (and clang++ where present)")
        return 1
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cuda_include = os.path.join(cuda_home, "include")
    have_cuda = os.path.isfile(os.path.join(cuda_include, "cuda_runtime.h"))

    jobs, skipped = [], 0
    for s in snippets:
        where = "%s:%d" % (guide_name, s.line)
        if s.problems:
            continue
        if s.skip is not None:
            print("[gdr-skip] guide_snippets_test: %s: %s" % (where, s.skip))
            skipped += 1
            continue
        if s.cuda and not have_cuda:
            print("[gdr-skip] guide_snippets_test: %s: needs the CUDA headers (%s not found)"
                  % (where, os.path.join(cuda_include, "cuda_runtime.h")))
            skipped += 1
            continue
        for c in compilers:
            jobs.append((s, c))

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [(s, c, pool.submit(compile_one, c, s.path, args.root, cuda_include, s)) for s, c in jobs]
        for s, c, fut in futures:
            rc, output = fut.result()
            ok, why = judge(s, c, rc, output)
            where = "%s:%d" % (guide_name, s.line)
            if ok:
                print("ok    %-9s %s (%s)" % (c, where, s.kind()))
            else:
                failed += 1
                print("FAIL  %-9s %s (%s): %s; the translation unit is %s" % (c, where, s.kind(), why, s.path))
                print(output.rstrip())
    checked = len(set(id(s) for s, _ in jobs))
    print("guide snippets: %d checked with %s, %d skipped, %d compile(s) failed"
          % (checked, " and ".join(compilers), skipped, failed))
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
