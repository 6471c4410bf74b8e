#!/usr/bin/env bash
# Builds and runs gdr's GPU-facing tests and the CUDA event benchmark WITHOUT
# Bazel: the GPU machine has g++ and nvcc but no Bazel, no Java and no
# liburing. Same sources as the Bazel targets:
#   tests/memory/*_test.cpp   with GDR_HAS_CUDA=1, and the tests that have a
#                             Device part also with GDR_HAS_CUDA=0 (as Bazel does)
#   tests/cuda/*_test.cpp     GDR_HAS_CUDA=1
#   tests/protocol/*_test.cpp the conformance suite (host memory) and the
#                             staged path's suite (also with GDR_HAS_CUDA=1)
#   tests/transport/shm/shm_ipc_test.cpp  CUDA IPC between processes, both ways
#   examples/quickstart.cpp   if present (built and run)
#   examples/gpu_pipeline.cpp with its kernels (gpu_pipeline_kernels.cu, nvcc
#                             -c first), run with --count 64 --size 16M
#   benchmarks/cuda_event_bench.cpp  (-O2, run once; CSV kept)
#   benchmarks/nop_bench.cpp, resume_bench.cpp  (-O2, run once each: the
#                             (a) and (b) ratios on this machine's CPU)
# Any *.cu among them goes through nvcc with -arch=sm_90.
#
# liburing: from Debian packages in .carry/ (git-ignored) when present:
#   echo /.carry/ >> .git/info/exclude; mkdir -p .carry
#   (cd .carry && apt-get download liburing2 liburing-dev)
# They are unpacked under $GDR_PREFIX (default /tmp/gdr-pfx) and linked
# statically; otherwise the system's -luring is used.
#
# Output: full logs in $OUT (default ./gpu-out): build.log, tests.log,
# bench.log, bench.csv, summary.txt. The summary is printed last.
# Exit status: 0 when everything built and no test failed (skips are fine).
#
# Environment: CXX (g++), NVCC ($CUDA_HOME/bin/nvcc), CUDA_HOME
# (/usr/local/cuda), GDR_WERROR (1: -Werror), GDR_JOBS (nproc),
# GDR_BENCH_ARGS (extra benchmark arguments, e.g. --quick), GDR_NO_BENCH=1,
# GDR_ONLY (an extended regex: build and run only the jobs whose name matches,
# e.g. 'shm_ipc'), GDR_SANITIZE=1 (tests and quickstart under ASan+UBSan, no benchmarks;
# ASan needs protect_shadow_gap=0 beside the CUDA driver's mappings, and leak
# checking is off because the driver keeps allocations until exit).
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
BUILD=${GDR_BUILD_DIR:-/tmp/gdr-gpu-build}
rm -rf "$BUILD"; mkdir -p "$BUILD"
CXX=${CXX:-g++}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [[ ! -d "$CUDA_HOME/include" ]] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
CUDART_A=$CUDA_HOME/lib64/libcudart_static.a
[[ -e "$CUDART_A" ]] || CUDART_A=$(ls "$CUDA_HOME"/targets/*/lib/libcudart_static.a 2>/dev/null | head -1)
NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}
JOBS=${GDR_JOBS:-$(nproc)}
WERROR=${GDR_WERROR:-1}
BUILD_LOG=$OUT/build.log; TEST_LOG=$OUT/tests.log; BENCH_LOG=$OUT/bench.log; SUMMARY=$OUT/summary.txt
: >"$BUILD_LOG"; : >"$TEST_LOG"; : >"$BENCH_LOG"; : >"$SUMMARY"

# ---- liburing ---------------------------------------------------------------
URING_INC=(); URING_LIB=(-luring)
if ls .carry/liburing*.deb >/dev/null 2>&1; then
  P=${GDR_PREFIX:-/tmp/gdr-pfx}
  for f in .carry/*.deb; do dpkg -x "$f" "$P"; done
  URING_INC=(-isystem "$P/usr/include")
  URING_LIB=("$P/usr/lib/x86_64-linux-gnu/liburing.a")
  echo "liburing: from .carry ($(ls .carry/liburing-dev*.deb | xargs -n1 basename))" >>"$BUILD_LOG"
else
  echo "liburing: system (-luring)" >>"$BUILD_LOG"
fi

WARN=(-Wall -Wextra -Wundef)
[[ "$WERROR" == 1 ]] && WARN+=(-Werror)
COMMON=(-std=c++20 "${WARN[@]}" -I"$ROOT" -isystem "$CUDA_HOME/include" "${URING_INC[@]}")
LIBS=("$CUDART_A" "${URING_LIB[@]}" -ldl -lrt -lpthread)
if [[ "${GDR_SANITIZE:-0}" == 1 ]]; then
  COMMON+=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0:abort_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1
  GDR_NO_BENCH=1
fi

{
  echo "host: $(uname -srm); $($CXX --version | head -1)"
  [[ -x "$NVCC" ]] && echo "nvcc: $("$NVCC" --version | tail -2 | head -1)" || echo "nvcc: not found at $NVCC"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} >>"$BUILD_LOG" 2>&1

# ---- what to build: "name|source|cuda(0/1)|kind(test/example/bench)[|run arguments]" ----
JOBFILE=$BUILD/jobs.txt; : >"$JOBFILE"
for src in tests/memory/*_test.cpp tests/memory/*_test.cu; do
  [[ -e "$src" ]] || continue
  base=$(basename "${src%.*}")
  echo "memory_${base}|$src|1|test" >>"$JOBFILE"
  # A test with a Device part is also built without CUDA, as Bazel does.
  if grep -q "GDR_HAS_CUDA" "$src"; then echo "memory_${base}_nocuda|$src|0|test" >>"$JOBFILE"; fi
done
for src in tests/cuda/*_test.cpp tests/cuda/*_test.cu; do
  [[ -e "$src" ]] || continue
  echo "cuda_$(basename "${src%.*}")|$src|1|test" >>"$JOBFILE"
done
# The protocol layer's suites (loopback and TCP): the conformance suite
# (host memory), and the staged path's, which is built both ways: on GPU
# memory with the CUDA copy engine, and on the CPU copy engine.
for src in tests/protocol/*_test.cpp; do
  [[ -e "$src" ]] || continue
  base=$(basename "${src%.*}")
  echo "protocol_${base}|$src|0|test" >>"$JOBFILE"
  if grep -q "GDR_HAS_CUDA" "$src" tests/protocol/*.hpp 2>/dev/null && [[ "$base" == staged* ]]; then
    echo "protocol_${base}_cuda|$src|1|test" >>"$JOBFILE"
  fi
done
# The shared-memory transport's CUDA IPC path: on the GPU (real IPC between
# processes), and on the CPU copy engine's stand-in.
for src in tests/transport/shm/shm_ipc_test.cpp; do
  [[ -e "$src" ]] || continue
  echo "transport_shm_ipc_test_cuda|$src|1|test" >>"$JOBFILE"
  echo "transport_shm_ipc_test|$src|0|test" >>"$JOBFILE"
done
# The GPUDirect probe's GPU half and the node probe (no RDMA device there:
# they read the GPU, then refuse with the check that failed), where
# libibverbs is installed.
if [[ -e /usr/include/infiniband/verbs.h ]] && ls /usr/lib/*/libibverbs.so* >/dev/null 2>&1; then
  for t in gpudirect probe; do
    [[ -e tests/verbs/${t}_test.cpp ]] && echo "verbs_${t}_test|tests/verbs/${t}_test.cpp|0|verbstest" >>"$JOBFILE"
  done
else
  echo "libibverbs: not installed, the verbs probe tests are not built" >>"$BUILD_LOG"
fi
[[ -e examples/quickstart.cpp ]] && echo "quickstart|examples/quickstart.cpp|1|example" >>"$JOBFILE"
[[ -e examples/quickstart.cu ]] && echo "quickstart|examples/quickstart.cu|1|example" >>"$JOBFILE"
[[ -e examples/gpu_pipeline.cpp ]] && echo "gpu_pipeline|examples/gpu_pipeline.cpp|1|example|--count 64 --size 16M" >>"$JOBFILE"
if [[ "${GDR_NO_BENCH:-0}" != 1 ]]; then
  echo "cuda_event_bench|benchmarks/cuda_event_bench.cpp|1|bench" >>"$JOBFILE"
  for b in nop_bench resume_bench; do
    [[ -e benchmarks/$b.cpp ]] && echo "$b|benchmarks/$b.cpp|0|hostbench" >>"$JOBFILE"
  done
fi

if [[ -n "${GDR_ONLY:-}" ]]; then
  grep -E "^[^|]*(${GDR_ONLY})[^|]*\|" "$JOBFILE" >"$JOBFILE.only"; mv "$JOBFILE.only" "$JOBFILE"
  echo "GDR_ONLY=${GDR_ONLY}: $(wc -l <"$JOBFILE") jobs" >>"$BUILD_LOG"
fi

# doctest's main, once.
if ! $CXX "${COMMON[@]}" -O1 -c tests/support/doctest_main.cpp -o "$BUILD/doctest_main.o" >>"$BUILD_LOG" 2>&1; then
  echo "FATAL: doctest_main.cpp did not build (are doctest headers installed?)" | tee -a "$SUMMARY"
  cat "$BUILD_LOG"; exit 1
fi

build_one() {  # name src cuda kind
  local name=$1 src=$2 cuda=$3 kind=$4 log="$BUILD/$1.build.log" opt=-O1 extra=()
  [[ "$kind" == bench || "$kind" == hostbench ]] && opt=-O2
  [[ "$kind" == test ]] && extra=("$BUILD/doctest_main.o")
  [[ "$kind" == verbstest ]] && extra=("$BUILD/doctest_main.o" -DGDR_HAS_VERBS=1 -libverbs)
  local t0=$SECONDS rc
  if [[ "$src" == *.cu ]]; then
    "$NVCC" -std=c++20 -arch=sm_90 $opt -DGDR_HAS_CUDA=$cuda -I"$ROOT" "${URING_INC[@]}" \
      -Xcompiler "$(IFS=,; echo "${WARN[*]}")" "$src" "${extra[@]}" -o "$BUILD/$name" \
      "${LIBS[@]}" >"$log" 2>&1
  else
    # Kernels beside the source (examples/<name>_kernels.cu) go through nvcc
    # first and are linked in (no -Wundef there: CUDA's own headers trip it).
    local kernels=${src%.cpp}_kernels.cu objs=()
    [[ -e "$kernels" ]] && objs=("$BUILD/$name.kernels.o")
    { [[ ${#objs[@]} == 0 ]] || "$NVCC" -std=c++20 -arch=sm_90 $opt -I"$ROOT" -c "$kernels" -o "${objs[0]}"; } >"$log" 2>&1 &&
      $CXX "${COMMON[@]}" $opt -g -DGDR_HAS_CUDA=$cuda "$src" "${objs[@]}" "${extra[@]}" -o "$BUILD/$name" "${LIBS[@]}" >>"$log" 2>&1
  fi
  rc=$?
  echo "$rc $((SECONDS - t0))" >"$BUILD/$name.build.rc"
}
export -f build_one
export BUILD NVCC CXX ROOT
export COMMON_STR="${COMMON[*]}"

# Parallel build (xargs -P); arrays do not cross the process boundary, so
# each job re-reads them from this script's environment via a wrapper.
{
  declare -p COMMON LIBS URING_INC WARN
  declare -f build_one
} >"$BUILD/env.sh"
t_build=$SECONDS
cut -d'|' -f1-4 "$JOBFILE" | tr '|' ' ' |
  xargs -P "$JOBS" -n 4 bash -c 'source "$0"; build_one "$@"' "$BUILD/env.sh"
t_build=$((SECONDS - t_build))

fails=0; build_fails=0
printf '%-38s %-10s %s\n' "binary" "status" "detail" >"$BUILD/summary.body"
while IFS='|' read -r name src cuda kind; do
  read -r rc secs <"$BUILD/$name.build.rc" 2>/dev/null || { rc=99; secs=0; }
  {
    echo "=== build $name ($src, GDR_HAS_CUDA=$cuda): rc=$rc, ${secs}s"
    cat "$BUILD/$name.build.log"
  } >>"$BUILD_LOG"
  if [[ "$rc" != 0 ]]; then
    build_fails=$((build_fails + 1))
    printf '%-38s %-10s %s\n' "$name" "BUILD-FAIL" "see build.log" >>"$BUILD/summary.body"
  fi
done <"$JOBFILE"

# ---- run ---------------------------------------------------------------------
t_run=$SECONDS
while IFS='|' read -r name src cuda kind args; do
  [[ -x "$BUILD/$name" ]] || continue
  case "$kind" in
    test | verbstest)
      log="$BUILD/$name.run.log"
      timeout 300 "$BUILD/$name" >"$log" 2>&1; rc=$?
      { echo "=== run $name ($src, GDR_HAS_CUDA=$cuda): rc=$rc"; cat "$log"; } >>"$TEST_LOG"
      counts=$(grep -E '^\[doctest\] test cases:' "$log" | tail -1 | sed -E 's/\[doctest\] test cases: *//; s/ +/ /g')
      skips=$(grep -c '^\[gdr-skip\]' "$log")
      if [[ "$rc" == 0 ]]; then status=PASS; else status=FAIL; fails=$((fails + 1)); fi
      detail="$counts; gdr-skips: $skips"
      [[ "$rc" == 124 ]] && detail="TIMEOUT after 300 s; $detail"
      printf '%-38s %-10s %s\n' "$name" "$status" "$detail" >>"$BUILD/summary.body"
      ;;
    example)
      log="$BUILD/$name.run.log"
      # shellcheck disable=SC2086
      timeout 120 "$BUILD/$name" ${args:-} >"$log" 2>&1; rc=$?
      { echo "=== run $name${args:+ $args}: rc=$rc"; cat "$log"; } >>"$TEST_LOG"
      if [[ "$rc" == 0 ]]; then status=PASS; else status=FAIL; fails=$((fails + 1)); fi
      printf '%-38s %-10s %s\n' "$name" "$status" "exit $rc" >>"$BUILD/summary.body"
      ;;
    bench)
      # shellcheck disable=SC2086
      timeout 400 "$BUILD/$name" --csv "$OUT/bench.csv" ${GDR_BENCH_ARGS:-} >"$BENCH_LOG" 2>&1; rc=$?
      if [[ "$rc" == 0 ]]; then status=RAN; else status=FAIL; fails=$((fails + 1)); fi
      detail="exit $rc"
      grep -q '^\[gdr-skip\]' "$BENCH_LOG" && detail="skipped: $(sed -n 's/^\[gdr-skip\] [^:]*: //p' "$BENCH_LOG")"
      printf '%-38s %-10s %s\n' "$name" "$status" "$detail" >>"$BUILD/summary.body"
      ;;
    hostbench)
      log="$OUT/$name.log"
      timeout 200 "$BUILD/$name" >"$log" 2>&1; rc=$?
      if [[ "$rc" == 0 ]]; then status=RAN; else status=FAIL; fails=$((fails + 1)); fi
      printf '%-38s %-10s %s\n' "$name" "$status" "$(grep '^ratio' "$log" | head -1)" >>"$BUILD/summary.body"
      ;;
  esac
done <"$JOBFILE"
t_run=$((SECONDS - t_run))

# ---- summary (last thing printed) -------------------------------------------------
{
  echo "==== gdr GPU test summary ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ===="
  sed -n '1,/^nvcc/p' "$BUILD_LOG" | grep -E '^(host|nvcc|liburing)' ; grep -E '^[A-Z].*, [0-9]+\.[0-9]+, ' "$BUILD_LOG" | head -2
  cat "$BUILD/summary.body"
  skip_reason=$(grep -h '^\[gdr-skip\]' "$BUILD"/*.run.log 2>/dev/null | sed 's/^\[gdr-skip\] [^:]*: //' | sort | uniq -c | sort -rn | head -3)
  [[ -n "$skip_reason" ]] && { echo "skip reasons (count):"; echo "$skip_reason"; }
  warnings=$(grep -c 'warning:' "$BUILD_LOG")
  echo "build: ${t_build}s with $JOBS jobs, $build_fails failed, $warnings warning lines; run: ${t_run}s"
  if grep -q '^RATIO' "$BENCH_LOG"; then echo "benchmark (medians; full table in bench.log):"; grep '^RATIO' "$BENCH_LOG"; fi
  if [[ $fails == 0 && $build_fails == 0 ]]; then echo "RESULT: OK"; else echo "RESULT: $fails failed, $build_fails did not build"; fi
} >"$SUMMARY"
cat "$SUMMARY"
[[ $fails == 0 && $build_fails == 0 ]]
