#!/bin/bash
# The layering check can fail: on copies of the real headers with one
# forbidden include added (directly, two headers down, behind
# `#if GDR_HAS_CUDA`), check_layering.sh must exit 1 and name the chain; on
# the unchanged copy it must pass, and on a tree without the headers a rule
# names it must refuse (exit 2) rather than pass.
#
#   bash tests/layering/check_layering_test.sh tests/layering/check_layering.sh .
set -uo pipefail

check=$1
src=$2  # holds gdr/
work=${TEST_TMPDIR:-$(mktemp -d)}
failures=0

# fresh_copy DIR: DIR/gdr is a writable copy of the headers (runfiles are links).
fresh_copy() {
  rm -rf "$1"
  mkdir -p "$1"
  cp -RL "$src/gdr" "$1/gdr"
}

# expect NAME STATUS PATTERN DIR: check_layering.sh on DIR exits STATUS and
# prints a line matching PATTERN.
expect() {
  local name=$1 status=$2 pattern=$3 dir=$4 out rc
  out=$(bash "$check" "$dir" 2>&1)
  rc=$?
  if [[ $rc -ne $status ]] || ! grep -qE -- "$pattern" <<<"$out"; then
    echo "FAIL: $name: expected exit $status and a line matching '$pattern', got exit $rc:"
    sed 's/^/    /' <<<"$out"
    failures=$((failures + 1))
  else
    echo "ok: $name"
  fi
}

fresh_copy "$work/clean"
expect "the headers as they are pass" 0 '^layering ok$' "$work/clean"

fresh_copy "$work/direct"
echo '#include <gdr/coro/when_all.hpp>' >>"$work/direct/gdr/sched/poller.hpp"
expect "a sched header including coro fails" 1 \
  '^  gdr/sched/poller.hpp -> gdr/coro/when_all.hpp$' "$work/direct"

fresh_copy "$work/transitive"
cat >"$work/transitive/gdr/sched/helper.hpp" <<'EOF'
#pragma once
#include <gdr/coro/task.hpp>
EOF
echo '#include <gdr/sched/helper.hpp>' >>"$work/transitive/gdr/sched/operation.hpp"
expect "sched reaching coro through another header fails" 1 \
  '^  gdr/sched/operation.hpp -> gdr/sched/helper.hpp -> gdr/coro/task.hpp$' "$work/transitive"

fresh_copy "$work/cuda"
printf '#if GDR_HAS_CUDA\n#include <gdr/cuda/stream.hpp>\n#endif\n' >>"$work/cuda/gdr/memory/space.hpp"
expect "a memory type including cuda, even behind GDR_HAS_CUDA, fails" 1 \
  '^  gdr/memory/space.hpp -> gdr/cuda/stream.hpp$' "$work/cuda"
# view.hpp includes space.hpp: the same violation reaches it too.
expect "the memory types above it fail with it" 1 \
  '^  gdr/memory/view.hpp -> gdr/memory/space.hpp -> gdr/cuda/stream.hpp$' "$work/cuda"

fresh_copy "$work/runtime"
echo '#include <cuda_runtime_api.h>' >>"$work/runtime/gdr/memory/remote_view.hpp"
expect "a memory type including a CUDA header fails" 1 \
  '^  gdr/memory/remote_view.hpp -> cuda_runtime_api.h$' "$work/runtime"

fresh_copy "$work/upward"
echo '#include <gdr/memory/view.hpp>' >>"$work/upward/gdr/cuda/stream.hpp"
expect "an include up the folder stack (cuda -> memory) fails" 1 \
  '^layering violation: gdr/cuda/stream.hpp includes gdr/memory/view.hpp \(cuda may include only folders below it\)$' \
  "$work/upward"

fresh_copy "$work/protocol_up"
echo '#include <gdr/transport/tcp/frame.hpp>' >>"$work/protocol_up/gdr/protocol/options.hpp"
expect "the protocol layer including a transport fails" 1 \
  'gdr/protocol/options.hpp includes gdr/transport/tcp/frame.hpp' "$work/protocol_up"

fresh_copy "$work/cycle"
# No transport folder includes another today: make both arrows.
echo '#include <gdr/transport/tcp/socket.hpp>' >>"$work/cycle/gdr/transport/verbs/connect.hpp"
echo '#include <gdr/transport/verbs/endpoint.hpp>' >>"$work/cycle/gdr/transport/tcp/frame.hpp"
expect "transport folders including each other in a cycle fail" 1 \
  "^layering violation: transport/'s folders include each other in a cycle:$" "$work/cycle"

fresh_copy "$work/newfolder"
mkdir -p "$work/newfolder/gdr/ipc"
printf '#pragma once\n#include <gdr/error.hpp>\n' >"$work/newfolder/gdr/ipc/ring.hpp"
expect "a folder with no place in the stack fails" 1 "folder 'ipc' has no place in the stack" "$work/newfolder"

fresh_copy "$work/long"
yes '// padding' | head -n 801 >>"$work/long/gdr/sched/timer.hpp"
expect "a header over 800 lines fails" 1 '^layering violation: gdr/sched/timer.hpp has [0-9]+ lines' "$work/long"

fresh_copy "$work/renamed"
rm "$work/renamed"/gdr/sched/*.hpp
expect "a rule that matches no header refuses to pass" 2 'no header matches' "$work/renamed"

if ((failures)); then
  echo "$failures case(s) failed"
  exit 1
fi
echo "all cases passed"
