#!/usr/bin/env bash
# Builds the stress runner and runs seeds for as long as asked:
#
#   tools/stress/run_seeds.sh [--config CONFIG] [--time SECONDS | --seeds A:B]
#                             [--transport T] [--mode M] [--jobs J] [-- RUNNER ARGS...]
#
#   --config   a bazel config (asan, clang-asan, tsan, clang); default: none
#   --time     run consecutive seeds until this many seconds have passed
#              (default 600), starting at --seeds A: (default: a seed drawn
#              from the clock, printed, so that long runs cover new seeds)
#   --seeds    A:B runs exactly seeds A..B-1
#   --transport, --mode, --jobs: passed to the runner (defaults all, all, 1)
#
# Prints one line per failing run (seed, transport, mode, what failed, the
# replay command) and the runner's summary; the whole output is also kept in
# stress-<config>-<first seed>.log in the directory it was called from. Exit
# status 0 if every run passed. A seed replays alone in the same config:
#   bazel-bin/tests/stress/stress --seed S --transport T --mode M [--log]
# (sanitizer configs run fewer operations per seed: GDR_STRESS_SCALE=0.4
# gives a default build the same plans).
set -euo pipefail

config=""
time_s=600
seeds=""
transport=all
mode=all
jobs=1
extra=()
while (($#)); do
  case "$1" in
    --config) config=$2; shift 2 ;;
    --time) time_s=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --mode) mode=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run_seeds.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

here=$(pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
bazel_args=(build //tests/stress:stress)
[[ -n $config ]] && bazel_args+=(--config="$config")
./bazelw "${bazel_args[@]}" >&2
# The binary of this config (bazel-bin follows the last build's config).
info_args=(info bazel-bin)
[[ -n $config ]] && info_args+=(--config="$config")
bin="$(./bazelw "${info_args[@]}" 2>/dev/null)/tests/stress/stress"
[[ -x $bin ]] || { echo "run_seeds.sh: no runner binary at '$bin'" >&2; exit 1; }

if [[ -z $seeds ]]; then
  seeds="$(( $(date +%s) % 1000000 * 1000 )):"
  run=(--time "$time_s" --seeds "$seeds")
elif [[ $seeds == *: ]]; then
  run=(--time "$time_s" --seeds "$seeds")
else
  run=(--seeds "$seeds")
fi
log="$here/stress-${config:-default}-${seeds%%:*}.log"
echo "run_seeds.sh: $bin ${run[*]} --transport $transport --mode $mode --jobs $jobs (log: $log)" >&2
set +e
"$bin" "${run[@]}" --transport "$transport" --mode "$mode" --jobs "$jobs" "${extra[@]}" | tee "$log"
status=${PIPESTATUS[0]}
exit "$status"
