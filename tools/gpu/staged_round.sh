#!/usr/bin/env bash
# One GPU-machine round for the staged path, in order of importance (what is
# written under $OUT survives a timeout):
#   1. tools/gpu/run_gpu_tests.sh (GDR_NO_BENCH=1; with GDR_SANITIZE=1 when
#      STAGED_SANITIZE=1): the GPU tests, the staged suite on GPU memory, the
#      examples;
#   2. gdr_staged --verify over TCP between two processes: random bytes,
#      every byte checked, at the sizes the staged path must get right;
#   3. benchmarks/staged/build_and_run.sh with gdr_staged as its gdr hook:
#      copy rates, the hand-written pipeline, naive and pinned programs, and
#      gdr's sweep, with ratios (report.txt);
#   4. gdr_staged in one process (staging forced; also both directions),
#      Pinned through gdr, and 8-byte latency of Device and Pinned.
#
#   OUT=/some/dir bash tools/gpu/staged_round.sh
# Environment: OUT, GDR_JOBS, STAGED_CHUNKS, STAGED_DEPTHS (the sweep),
# STAGED_SKIP_TESTS=1 (steps 2-4 only).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/staged-round}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$OUT/round.txt"; }

if [[ "${STAGED_SKIP_TESTS:-0}" != 1 ]]; then
  GDR_NO_BENCH=1 GDR_SANITIZE=${STAGED_SANITIZE:-0} OUT=$OUT/tests bash tools/gpu/run_gpu_tests.sh >"$OUT/tests.out" 2>&1
  say "tests: exit $? ($(grep RESULT "$OUT/tests/summary.txt" 2>/dev/null))"
fi

# gdr_staged, built like the tests (static cudart, liburing from .carry).
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
P=/tmp/gdr-pfx
for f in .carry/*.deb; do [[ -e "$f" ]] && dpkg -x "$f" "$P"; done
BIN=/tmp/gdr-staged-round
mkdir -p "$BIN"
if g++ -std=c++20 -O2 -Wall -Wextra -Wundef -Werror -I. -isystem "$CUDA_HOME/include" -isystem "$P/usr/include" \
    -DGDR_HAS_CUDA=1 benchmarks/staged/gdr_staged.cpp -o "$BIN/gdr_staged" "$CUDA_HOME/lib64/libcudart_static.a" \
    "$P/usr/lib/x86_64-linux-gnu/liburing.a" -ldl -lrt -lpthread >"$OUT/gdr_staged.build.log" 2>&1; then
  say "gdr_staged built"
else
  say "gdr_staged: BUILD FAILED"; cat "$OUT/gdr_staged.build.log"; exit 1
fi
G=$BIN/gdr_staged

timeout 200 "$G" --mode tcp2 --verify --chunks 1M,256K --depths 4,2 --iters 1 \
  --sizes 0,1,7,4095,1048575,1048576,1048577,262143,262145,67108867,1073741824 >"$OUT/verify.csv" 2>"$OUT/verify.log"
say "verify: exit $? ($(grep -c 'VERIFY FAILED' "$OUT/verify.log") failures)"

GDR_STAGED_BENCH=$G OUT=$OUT/bench timeout 330 bash benchmarks/staged/build_and_run.sh >"$OUT/bench.out" 2>&1
say "build_and_run: exit $?"

timeout 60 "$G" --mode tcp2 --space pinned --sweep --chunks 1M --depths 4 >"$OUT/pinned.csv" 2>>"$OUT/extra.log"
say "pinned: exit $?"
timeout 60 "$G" --mode loop1 --sweep --chunks ${STAGED_CHUNKS:-256K,1M,4M} --depths 4 >"$OUT/loop1.csv" 2>>"$OUT/extra.log"
say "loop1: exit $?"
timeout 60 "$G" --mode loop1 --both --sizes 16M,256M --chunks 1M --depths 4 >"$OUT/both.csv" 2>>"$OUT/extra.log"
say "both: exit $?"
timeout 60 "$G" --mode lat --space device >"$OUT/lat.csv" 2>>"$OUT/extra.log"
timeout 60 "$G" --mode lat --space pinned >>"$OUT/lat.csv" 2>>"$OUT/extra.log"
say "lat: exit $?"
say "done"
