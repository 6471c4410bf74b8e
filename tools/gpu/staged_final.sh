#!/usr/bin/env bash
# The staged path's measured round on a GPU machine, the numbers in
# benchmarks/RESULTS.md ("staged path") come from. What is written under $OUT
# survives a timeout; at the end everything is packed into $OUT/*.tgz.
#   1. tools/gpu/run_gpu_tests.sh, plain and under ASan+UBSan;
#   2. gdr_staged --verify (two processes, random bytes, every byte checked);
#   3. REPS rounds, alternating in this order, of the sweep 1 MiB..1 GiB:
#      the hand-written pipeline (raw_pipeline, 1 MiB and 4 MiB chunks, depth
#      4), the naive program, gdr with Device memory (its defaults), gdr with
#      Pinned memory;
#   4. copy_rates (D2H, memcpy, H2D) beside gdr in one process with staging
#      forced (loop1), and both directions at once;
#   5. 8-byte latency, Device and Pinned, two processes and one process;
#   6. examples/gpu_pipeline, when the GPU script builds it.
#
#   OUT=/some/dir REPS=3 bash tools/gpu/staged_final.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/staged-final}
REPS=${REPS:-3}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
t0=$SECONDS
say() { echo "[$((SECONDS - t0))s] $*" | tee -a "$OUT/round.txt"; }

if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  OUT=$OUT/tests bash tools/gpu/run_gpu_tests.sh >"$OUT/tests.out" 2>&1
  say "tests: exit $? ($(grep RESULT "$OUT/tests/summary.txt"))"
  GDR_SANITIZE=1 OUT=$OUT/asan bash tools/gpu/run_gpu_tests.sh >"$OUT/asan.out" 2>&1
  say "tests under ASan+UBSan: exit $? ($(grep RESULT "$OUT/asan/summary.txt"))"
fi

P=/tmp/gdr-pfx
for f in .carry/*.deb; do [[ -e "$f" ]] && dpkg -x "$f" "$P"; done
BIN=/tmp/gdr-staged-final
mkdir -p "$BIN"
build() {  # name source
  g++ -std=c++20 -O2 -Wall -Wextra -Wundef -Werror -I. -isystem "$CUDA_HOME/include" -isystem "$P/usr/include" \
    -DGDR_HAS_CUDA=1 "$2" -o "$BIN/$1" "$CUDA_HOME/lib64/libcudart_static.a" \
    "$P/usr/lib/x86_64-linux-gnu/liburing.a" -ldl -lrt -lpthread >>"$OUT/build.log" 2>&1
}
build gdr_staged benchmarks/staged/gdr_staged.cpp && build raw_pipeline benchmarks/staged/raw_pipeline.cpp &&
  build copy_rates benchmarks/staged/copy_rates.cpp || { say "BUILD FAILED"; cat "$OUT/build.log"; exit 1; }
say "built"
G=$BIN/gdr_staged R=$BIN/raw_pipeline

timeout 200 "$G" --mode tcp2 --verify --chunks 4M,1M,256K --depths 4,2 --iters 1 \
  --sizes 0,1,7,4095,262143,262144,262145,1048575,1048576,1048577,4194303,4194304,4194305,67108867,1073741824 \
  >"$OUT/verify.csv" 2>"$OUT/verify.log"
say "verify: exit $? ($(grep -c 'VERIFY FAILED' "$OUT/verify.log") failures)"

for rep in $(seq "$REPS"); do
  timeout 120 "$R" --sweep --modes raw --chunks 1M,4M --depths 4 --wait sync >>"$OUT/raw.csv" 2>>"$OUT/raw.log"
  timeout 60 "$R" --sweep --modes naive >>"$OUT/naive.csv" 2>>"$OUT/naive.log"
  timeout 120 "$G" --mode tcp2 --sweep >>"$OUT/gdr_device.csv" 2>>"$OUT/gdr.log"
  timeout 60 "$G" --mode tcp2 --space pinned --sweep >>"$OUT/gdr_pinned.csv" 2>>"$OUT/gdr.log"
  say "round $rep done"
done

timeout 60 "$BIN/copy_rates" >"$OUT/copy_rates.csv" 2>"$OUT/copy_rates.log"
timeout 60 "$G" --mode loop1 --sweep --chunks 256K,1M,4M >"$OUT/loop1.csv" 2>>"$OUT/gdr.log"
timeout 60 "$G" --mode loop1 --both --sizes 16M,256M,1G >"$OUT/both.csv" 2>>"$OUT/gdr.log"
say "in-process runs done"
timeout 60 "$G" --mode lat --space device >"$OUT/lat.csv" 2>>"$OUT/gdr.log"
timeout 60 "$G" --mode lat --space pinned >>"$OUT/lat.csv" 2>>"$OUT/gdr.log"
timeout 60 "$G" --mode lat1 >>"$OUT/lat.csv" 2>>"$OUT/gdr.log"
say "latency done"
say "done"
# Pack everything into one file (a machine that returns few files gets all).
tar czf /tmp/staged-results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -maxdepth 1 ! -name round.txt -exec rm -rf {} + &&
  mv /tmp/staged-results.tgz "$OUT/results.tgz"
