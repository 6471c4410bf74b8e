#!/bin/bash
# Compiles every ```cpp block of docs/GUIDE.md on its own (g++, and clang++
# where installed): see the convention at the top of extract_snippets.py.
# Fails when a snippet does not compile, or when one marked `error` does.
#   $1  docs/GUIDE.md    $2  extract_snippets.py    (runfiles paths)
set -euo pipefail
guide=$1
script=$2
# The repository root holds docs/ and gdr/ (//gdr:all_headers is data).
root=$(cd "$(dirname "$guide")/.." && pwd)
work=${TEST_TMPDIR:-$(mktemp -d)}/guide_snippets
if ! command -v python3 >/dev/null; then
  echo "guide_snippets_test: python3 not found" >&2
  exit 1
fi
exec python3 "$script" "$guide" --root "$root" --out "$work"
