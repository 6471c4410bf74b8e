#!/usr/bin/env bash
# What the sanitizer configs leave out, checked (.bazelrc says why they do):
#
# 1. --config=tsan runs only the tests tagged "threads". Every test target
#    with a source or helper that starts a thread (std::thread,
#    std::jthread, std::async, pthread_create) must carry the tag.
# 2. The sanitizer configs leave out the tests tagged "hardware_only":
#    every case of such a test needs a GPU or an RDMA device, so on a CPU
#    machine it only skips. Given the default config's test logs
#    (TESTLOGS), each such test must have run no case there (its doctest
#    summary's passed cases are all `[gdr-skip]` ones); a case that runs
#    without the hardware would miss the sanitizers.
#
#   bash .ci/sanitizer-scope.sh [TESTLOGS]     (from the repository root)
#
# Prints what is wrong; exit status 1 if anything is.
set -uo pipefail
cd "$(dirname "$0")/.."
testlogs=${1:-}
bad=0

# 1. threads
labels=()
while IFS= read -r f; do
  d=$(dirname "$f")
  while [[ ! -f $d/BUILD.bazel && $d != . ]]; do d=$(dirname "$d"); done
  labels+=("//$d:${f#"$d"/}")
done < <(grep -rlE 'std::(j?thread|async)\b|pthread_create' tests --include='*.cpp' --include='*.hpp' | sort)
if ((${#labels[@]} == 0)); then
  echo "sanitizer-scope: no test starts a thread (nothing for --config=tsan to run)"
  bad=1
else
  query="tests(rdeps(//tests/..., set(${labels[*]}), 1)) except attr(tags, '\bthreads\b', //tests/...)"
  if ! missing=$(./bazelw query "$query" 2>/dev/null); then
    echo "sanitizer-scope: bazel query failed: $query"
    bad=1
  elif [[ -n $missing ]]; then
    echo "sanitizer-scope: these tests start threads but are not tagged \"threads\" (--config=tsan would skip them):"
    echo "$missing"
    bad=1
  else
    echo "sanitizer-scope: ${#labels[@]} sources start threads; every test built from them is tagged \"threads\""
  fi
fi

# 2. hardware_only
if [[ -n $testlogs ]]; then
  if ! hw=$(./bazelw query "attr(tags, '\bhardware_only\b', tests(//...))" 2>/dev/null); then
    echo "sanitizer-scope: bazel query for the hardware_only tests failed"
    bad=1
  else
    n=0
    for label in $hw; do
      n=$((n + 1))
      tlog=${label#//}; tlog=$testlogs/${tlog/://}/test.log
      summary=$( [[ -f $tlog ]] && grep -E '^\[doctest\] test cases:' "$tlog" | tail -1)
      if [[ -z $summary ]]; then
        echo "sanitizer-scope: $label: no doctest summary in the default config's log"
        bad=1
        continue
      fi
      passed=$(sed -E 's/.*\| *([0-9]+) passed.*/\1/' <<<"$summary")
      skips=$(grep -c '^\[gdr-skip\]' "$tlog")
      if ((passed > skips)); then
        echo "sanitizer-scope: $label is tagged hardware_only but ran $((passed - skips)) case(s) here: untag it, or the sanitizers miss them"
        bad=1
      fi
    done
    ((bad == 0)) && echo "sanitizer-scope: $n hardware_only tests ran no case without the hardware"
  fi
fi
exit $bad
