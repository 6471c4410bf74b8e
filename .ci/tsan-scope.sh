#!/usr/bin/env bash
# --config=tsan runs only the tests tagged "threads" (.bazelrc). This checks
# that the tag is where it must be: every test target with a source or
# helper that starts a thread (std::thread, std::jthread, std::async,
# pthread_create) carries it. Prints what is missing; exit status 1 if any.
#   bash .ci/tsan-scope.sh        (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."

labels=()
while IFS= read -r f; do
  d=$(dirname "$f")
  while [[ ! -f $d/BUILD.bazel && $d != . ]]; do d=$(dirname "$d"); done
  labels+=("//$d:${f#"$d"/}")
done < <(grep -rlE 'std::(j?thread|async)\b|pthread_create' tests --include='*.cpp' --include='*.hpp' | sort)

if ((${#labels[@]} == 0)); then
  echo "tsan-scope: no test starts a thread (nothing for --config=tsan to run)"
  exit 1
fi

query="tests(rdeps(//tests/..., set(${labels[*]}), 1)) except attr(tags, '\bthreads\b', //tests/...)"
if ! missing=$(./bazelw query "$query" 2>/dev/null); then
  echo "tsan-scope: bazel query failed: $query"
  exit 1
fi
if [[ -n $missing ]]; then
  echo "tsan-scope: these tests start threads but are not tagged \"threads\" (--config=tsan would skip them):"
  echo "$missing"
  exit 1
fi
echo "tsan-scope: ${#labels[@]} sources start threads; every test built from them is tagged"
