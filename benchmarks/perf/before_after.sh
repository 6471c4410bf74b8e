#!/usr/bin/env bash
# Runs two builds of gdr_perf side by side, alternating, on the same machine:
# the TCP endpoint before and after a change, each against the raw sockets
# of its own run (the ratios are what compare; absolute numbers drift).
#
#   benchmarks/perf/before_after.sh OLD_BINARY NEW_BINARY OUT_DIR [CPUS]
#
# Build each with:
#   g++ -std=c++20 -O2 -DNDEBUG -static -I. benchmarks/perf/gdr_perf.cpp \
#       -o gdr_perf_X /usr/lib/x86_64-linux-gnu/liburing.a -lpthread
# Prints each run's table (busy-poll: sizes 8 B to 64 MiB, twice each, in
# the order new, old, new, old; then five 8-byte round trips each,
# alternating; then sleep mode once each) and keeps the CSVs in OUT_DIR.
set -u
old=$1 new=$2 out=$3 cpus=${4:-2,3}
mkdir -p "$out"
sizes=8,262144,2097152,16777216,67108864
run() {  # label binary mode sizes reps
  echo "=== $1 ($3, sizes $4)"
  "$2" --sizes "$4" --mode "$3" --cpus "$cpus" --no-external --bw-reps "$5" --csv "$out/$1_$3.csv" 2>/dev/null |
    grep -E '^ +(size|[0-9])'
}
for i in 1 2; do
  run "new$i" "$new" busy "$sizes" 3
  run "old$i" "$old" busy "$sizes" 3
done
for i in 1 2 3 4 5; do
  run "new_rtt$i" "$new" busy 8 1
  run "old_rtt$i" "$old" busy 8 1
done
run new_sleep "$new" sleep "$sizes" 3
run old_sleep "$old" sleep "$sizes" 3
rm -f gdr_perf.png
