#!/usr/bin/env bash
# Builds and runs the staged-path baselines on the GPU machine, WITHOUT Bazel
# (it has g++ and the CUDA toolkit only). Steps, each with its elapsed time:
#   1. build copy_rates and raw_pipeline with g++ (static cudart)
#   2. copy_rates: D2H, H2D, memcpy, the hand chain, both directions at once
#   3. raw_pipeline --verify: every byte checked, raw/naive/pinned, awkward
#      sizes (0, 1, 4095, 1 MiB+3, 64 MiB+3) and chunk/depth pairs
#   4. tuning: raw at 256 MiB, chunk 1 MiB, depth 4: --wait spin against sync,
#      then the kernel's socket buffers against --sockbuf 4M; the faster
#      settings are used for the sweep (and printed)
#   5. the sweep: raw (every chunk and depth), naive, pinned; 1 MiB .. 1 GiB
#   6. HOOK: the gdr benchmark, when GDR_STAGED_BENCH is set (see below)
#   7. report.py: tables, and gdr's ratios when step 6 ran
# About 2-3 minutes on an H200 with 16 cores (under 4 expected).
#
#   bash benchmarks/staged/build_and_run.sh
#   GDR_STAGED_BENCH=/path/to/gdr_staged_bench bash benchmarks/staged/build_and_run.sh
#
# Output in $OUT (default ./staged-out): build.log, copy_rates.csv/.log,
# verify.log, tuning.csv/.log, raw_pipeline.csv/.log, gdr_staged.csv/.log,
# report.txt, summary.txt (printed last). Exit status 0 when everything built,
# verified and ran; "[gdr-skip]" (no usable GPU) counts as a failure here.
#
# Environment: CXX (g++), CUDA_HOME (/usr/local/cuda, else the toolkit of the
# nvcc on PATH), STAGED_BUILD_DIR (/tmp/gdr-staged-build), STAGED_CHUNKS
# (256K,1M,4M,16M), STAGED_DEPTHS (2,4,8), STAGED_RAW_ARGS (more raw_pipeline
# arguments for tuning and sweep, e.g. "--cpus 2,3"), GDR_STAGED_BENCH and
# GDR_STAGED_ARGS (step 6).
set -u
OUT=${OUT:-$PWD/staged-out}
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd) || exit 1
BUILD=${STAGED_BUILD_DIR:-/tmp/gdr-staged-build}
rm -rf "$BUILD"
mkdir -p "$BUILD"
CXX=${CXX:-g++}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [[ ! -d "$CUDA_HOME/include" ]] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
CUDART_A=$CUDA_HOME/lib64/libcudart_static.a
if [[ ! -e "$CUDART_A" ]]; then
  for f in "$CUDA_HOME"/targets/*/lib/libcudart_static.a; do [[ -e "$f" ]] && CUDART_A=$f && break; done
fi
CHUNKS=${STAGED_CHUNKS:-256K,1M,4M,16M}
DEPTHS=${STAGED_DEPTHS:-2,4,8}
read -ra RAW_ARGS <<<"${STAGED_RAW_ARGS:-}"
read -ra GDR_ARGS <<<"${GDR_STAGED_ARGS:-}"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY.body"
rm -f "$OUT"/copy_rates.csv "$OUT"/raw_pipeline.csv "$OUT"/tuning.csv "$OUT"/gdr_staged.csv "$OUT"/report.txt
T_ALL=$SECONDS
failures=()

say() { echo "$*" | tee -a "$SUMMARY.body" >&2; }
# check NAME RC STDOUT_FILE: sets ST to OK, SKIPPED (no GPU: a failure
# here), TIMEOUT or FAIL, and records a failure. (Not in $(...): a subshell
# would lose the record.)
check() {
  local name=$1 rc=$2 out=$3
  if grep -q '^\[gdr-skip\]' "$out" 2>/dev/null; then
    failures+=("$name skipped"); ST="SKIPPED: $(grep -m1 '^\[gdr-skip\]' "$out")"
  elif [[ $rc == 124 ]]; then
    failures+=("$name timed out"); ST="TIMEOUT"
  elif [[ $rc != 0 ]]; then
    failures+=("$name failed"); ST="FAIL (exit $rc)"
  else
    ST="OK"
  fi
}
# The median GB/s (6th column) of the one CSV row in a raw_pipeline output.
median_of() { awk -F, '$1 == "raw" { print $6 }' "$1" | head -1; }
faster() { awk -v a="${1:-0}" -v b="${2:-0}" 'BEGIN { exit !(b + 0 > a + 0) }'; }  # b > a

{
  echo "host: $(uname -srm); $($CXX --version | head -1); CUDA_HOME=$CUDA_HOME"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} >"$OUT/build.log" 2>&1
cat "$OUT/build.log" >>"$SUMMARY.body"

# ---- 1. build ------------------------------------------------------------------
t=$SECONDS
FLAGS=(-O2 -std=c++20 -Wall -Wextra -Wundef -I. -isystem "$CUDA_HOME/include")
LIBS=("$CUDART_A" -ldl -lrt -lpthread)
for b in raw_pipeline copy_rates; do
  ( "$CXX" "${FLAGS[@]}" "benchmarks/staged/$b.cpp" -o "$BUILD/$b" "${LIBS[@]}" >"$BUILD/$b.build.log" 2>&1
    echo $? >"$BUILD/$b.rc" ) &
done
wait
build_ok=1
for b in raw_pipeline copy_rates; do
  rc=$(cat "$BUILD/$b.rc" 2>/dev/null || echo 99)
  { echo "=== $b: exit $rc"; cat "$BUILD/$b.build.log"; } >>"$OUT/build.log"
  if [[ $rc != 0 ]]; then build_ok=0; failures+=("build of $b"); fi
done
say "build: $([[ $build_ok == 1 ]] && echo OK || echo FAIL), $(grep -c 'warning:' "$OUT/build.log") warning lines ($((SECONDS - t)) s; build.log)"
if [[ $build_ok != 1 ]]; then
  cat "$OUT/build.log" >&2
  { echo "==== staged-path baselines: build failed ===="; cat "$SUMMARY.body"; echo "RESULT: FAILED: $(printf '%s; ' "${failures[@]}")"; } >"$SUMMARY"
  rm -f "$SUMMARY.body"; cat "$SUMMARY"; exit 1
fi
RP=$BUILD/raw_pipeline

# ---- 2. copy_rates -----------------------------------------------------------------
t=$SECONDS
timeout 150 "$BUILD/copy_rates" --chunks "$CHUNKS" --depths "$DEPTHS" >"$OUT/copy_rates.csv" 2>"$OUT/copy_rates.log"
check copy_rates $? "$OUT/copy_rates.csv"
say "copy_rates: $ST ($((SECONDS - t)) s; copy_rates.csv)"

# ---- 3. verify -------------------------------------------------------------------
t=$SECONDS
timeout 180 "$RP" --verify --modes raw,naive,pinned --sizes 0,1,4095,1M+3,64M+3 --chunks 256K,1M,16M --depths 2,3 \
  --iters 2 >"$OUT/verify.out" 2>"$OUT/verify.log"
rc=$?
cat "$OUT/verify.out" >>"$OUT/verify.log"
check verify $rc "$OUT/verify.out"
say "verify: $ST, $(grep -c '^verify OK' "$OUT/verify.log") points checked ($((SECONDS - t)) s; verify.log)"
grep -E 'VERIFY FAILED|ERROR' "$OUT/verify.log" | head -3 | tee -a "$SUMMARY.body" >&2

# ---- 4. tuning: event wait, then socket buffers -------------------------------------------
t=$SECONDS
echo "variant,mode,size,chunk,depth,iters,median_gbps,min_gbps,max_gbps" >"$OUT/tuning.csv"
: >"$OUT/tuning.log"
tune() {  # NAME ARGS...: one raw point; prints its median GB/s
  local name=$1; shift
  echo "=== $name: $*" >>"$OUT/tuning.log"
  timeout 90 "$RP" --size 256M --chunk 1M --depth 4 --iters 10 --warmup 2 "${RAW_ARGS[@]}" "$@" \
    >"$BUILD/tune_$name.csv" 2>>"$OUT/tuning.log"
  local rc=$?
  awk -F, -v v="$name" '$1 == "raw" { print v "," $0 }' "$BUILD/tune_$name.csv" >>"$OUT/tuning.csv"
  check "tuning $name" $rc "$BUILD/tune_$name.csv"
  echo "tuning $name: $ST" >>"$OUT/tuning.log"
  [[ $ST != OK ]] && say "tuning $name: $ST (tuning.log)"
  TUNE_GBPS=""
  [[ $rc == 0 ]] && TUNE_GBPS=$(median_of "$BUILD/tune_$name.csv")
}
tune spin --wait spin; spin=$TUNE_GBPS
tune sync --wait sync; sync=$TUNE_GBPS
WAIT=spin; best=$spin
if faster "$spin" "$sync"; then WAIT=sync; best=$sync; fi
tune "${WAIT}_sockbuf4M" --wait "$WAIT" --sockbuf 4M; buf=$TUNE_GBPS
TUNED=(--wait "$WAIT")
if faster "$best" "$buf"; then TUNED+=(--sockbuf 4M); fi
say "tuning (256 MiB, 1 MiB x 4, GB/s): spin ${spin:-?}, sync ${sync:-?}, $WAIT + sockbuf 4M ${buf:-?} -> sweep uses: ${TUNED[*]} ($((SECONDS - t)) s; tuning.csv)"

# ---- 5. the sweep ----------------------------------------------------------------------
t=$SECONDS
timeout 330 "$RP" --sweep --modes raw,naive,pinned --chunks "$CHUNKS" --depths "$DEPTHS" "${TUNED[@]}" "${RAW_ARGS[@]}" \
  >"$OUT/raw_pipeline.csv" 2>"$OUT/raw_pipeline.log"
rc=$?
check sweep $rc "$OUT/raw_pipeline.csv"
say "sweep: $ST, $(grep -cE '^(raw|naive|pinned),' "$OUT/raw_pipeline.csv") rows ($((SECONDS - t)) s; raw_pipeline.csv)"

# ---- 6. HOOK: the gdr benchmark ----------------------------------------------------------
# Set GDR_STAGED_BENCH to the gdr staged benchmark's executable. It is run
# with the sweep's arguments (--sweep --chunks C --depths D, then
# GDR_STAGED_ARGS) and must print raw_pipeline's CSV on stdout
# (mode,size,chunk,depth,iters,median_gbps,min_gbps,max_gbps) with its own
# mode name, e.g. "gdr"; stdout -> gdr_staged.csv, stderr -> gdr_staged.log.
GDR_CSV=""
if [[ -n "${GDR_STAGED_BENCH:-}" ]]; then
  t=$SECONDS
  if [[ -x "$GDR_STAGED_BENCH" ]]; then
    timeout 330 "$GDR_STAGED_BENCH" --sweep --chunks "$CHUNKS" --depths "$DEPTHS" "${GDR_ARGS[@]}" \
      >"$OUT/gdr_staged.csv" 2>"$OUT/gdr_staged.log"
    rc=$?
    check gdr $rc "$OUT/gdr_staged.csv"
    say "gdr: $ST, $(grep -cvE '^(mode,|\[)' "$OUT/gdr_staged.csv") rows ($((SECONDS - t)) s; gdr_staged.csv)"
    [[ -s "$OUT/gdr_staged.csv" ]] && GDR_CSV=$OUT/gdr_staged.csv
  else
    failures+=("gdr benchmark not executable")
    say "gdr: FAIL: GDR_STAGED_BENCH=$GDR_STAGED_BENCH is not an executable file"
  fi
else
  say "gdr: not run (GDR_STAGED_BENCH is not set)"
fi

# ---- 7. report ---------------------------------------------------------------------------
if grep -qE '^(raw|naive|pinned),' "$OUT/raw_pipeline.csv" 2>/dev/null; then
  args=(--raw "$OUT/raw_pipeline.csv")
  grep -qE '^[a-z0-9_]+,[0-9]+,[0-9]+,' "$OUT/copy_rates.csv" 2>/dev/null && args+=(--copy "$OUT/copy_rates.csv")
  [[ -n "$GDR_CSV" ]] && args+=(--gdr "$GDR_CSV")
  python3 benchmarks/staged/report.py "${args[@]}" >"$OUT/report.txt" 2>&1 || failures+=("report")
fi

{
  echo "==== staged-path baselines ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ===="
  cat "$SUMMARY.body"
  [[ -s "$OUT/report.txt" ]] && cat "$OUT/report.txt"
  echo "elapsed: $((SECONDS - T_ALL)) s; files in $OUT"
  if [[ ${#failures[@]} == 0 ]]; then echo "RESULT: OK"; else echo "RESULT: FAILED: $(printf '%s; ' "${failures[@]}")"; fi
} >"$SUMMARY"
rm -f "$SUMMARY.body" "$OUT/verify.out"
cat "$SUMMARY"
[[ ${#failures[@]} == 0 ]]
