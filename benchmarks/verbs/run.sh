#!/usr/bin/env bash
# gdr's verbs transport against perftest on the same Soft-RoCE link, in one
# guest, alternating (gdr, then perftest, per repetition), medians of REPS.
#
#   bash benchmarks/verbs/run.sh [VERBS_BENCH] [REPS] [WINDOW]   # on the host, as root
#
# VERBS_BENCH is the built benchmark (default: bazel-bin's
# benchmarks/verbs/verbs_bench, built with -c opt). WINDOW (or the
# environment's WINDOW; default 128, perftest's default --tx-depth) is the
# operations in flight of every bandwidth measurement: gdr's sliding window,
# and perftest's -t. The guest comes from tools/rxe/run-in-rxe-vm.sh. Prints
# each measurement, then a table of medians and ratios (gdr / perftest).
# LAT_ITERS (default 1000) is the iterations of every latency measurement
# (gdr's and perftest's -n): 1000 is 20-40 ms under emulation, where one
# slow moment of the host moves a whole sample; 20000 gives steadier
# medians. LAT_ONLY=1 measures the latency rows alone.
# What each latency is (one-way for send and write/put, a round trip for
# read/get) is written in verbs_bench.cpp's header.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
bench=${1:-$here/bazel-bin/benchmarks/verbs/verbs_bench}
reps=${2:-3}
window=${3:-${WINDOW:-128}}
[[ $window =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: WINDOW must be a positive number, not '$window'" >&2; exit 2; }
bench=$(readlink -f "$bench")
[[ -x $bench ]] || { echo "run.sh: no benchmark at $bench (./bazelw build -c opt //benchmarks:verbs/verbs_bench)" >&2; exit 2; }
out=$(mktemp -d /var/tmp/gdr-verbs-bench.XXXXXX)
cat >"$out/guest.sh" <<'GUEST'
#!/bin/bash
# In the guest: $1 = benchmark, $2 = repetitions, $3 = window, $4 = the repository,
# $5 = latency iterations, $6 = 1: latency rows only.
B=$1; R=$2; W=$3; IP=$RXEVM_IP; N=$5; LAT_ONLY=$6
source "$4/benchmarks/verbs/perftest_pair.sh"
lat() { awk -v s=$1 '$1 == s {print "typical_us=" $5 " avg_us=" $6}'; }
bw() { awk -v s=$1 '$1 == s {print "MBps=" $4}'; }
for r in $(seq 1 $R); do
  echo "# repetition $r"
  timeout 60 $B $IP send_lat 8 $N
  echo "ib_send_lat $(pt ib_send_lat -s 8 -n $N | lat 8)"
  timeout 60 $B $IP put_lat 8 $N
  echo "ib_write_lat $(pt ib_write_lat -s 8 -n $N | lat 8)"
  timeout 60 $B $IP get_lat 8 $N
  echo "ib_read_lat $(pt ib_read_lat -s 8 -n $N | lat 8)"
  timeout 60 $B $IP atomic_lat 8 $N
  echo "ib_atomic_lat $(pt ib_atomic_lat -n $N | lat 8)"
  GDR_BENCH_CHECKED=1 timeout 60 $B $IP put_lat 8 $N
  GDR_BENCH_CHECKED=1 timeout 60 $B $IP atomic_lat 8 $N
  [[ $LAT_ONLY == 1 ]] && continue
  timeout 120 $B $IP send_bw 65536 2000 $W
  echo "ib_write_bw $(pt ib_write_bw -s 65536 -n 2000 -t $W | bw 65536)"
  timeout 120 $B $IP put_bw 65536 2000 $W
  echo "ib_write_bw_R $(pt ib_write_bw -R -s 65536 -n 2000 -t $W | bw 65536)"
  timeout 120 $B $IP get_bw 65536 2000 $W
  echo "ib_read_bw $(pt ib_read_bw -s 65536 -n 2000 -t $W | bw 65536)"
  echo "ib_read_bw_R $(pt ib_read_bw -R -s 65536 -n 2000 -t $W | bw 65536)"
  GDR_BENCH_CHECKED=1 timeout 120 $B $IP put_bw 65536 2000 $W
  timeout 120 $B $IP batch_bw 16384 20 512
  echo "ib_write_bw_16k $(pt ib_write_bw -s 16384 -n 10240 -t $W | bw 16384)"
done
GUEST
chmod +x "$out/guest.sh"
"$here/tools/rxe/run-in-rxe-vm.sh" --timeout 1800 -- "$out/guest.sh" "$bench" "$reps" "$window" "$here" "${LAT_ITERS:-1000}" "${LAT_ONLY:-0}" | tee "$out/raw.txt"
python3 - "$out/raw.txt" "$window" <<'PY'
import re, statistics, sys
window = sys.argv[2]
vals = {}
for line in open(sys.argv[1]):
    w = line.split()
    if not w or w[0].startswith('#'): continue
    name = {'gdr-verbs': 'gdr_' + w[1], 'gdr-verbs-checked': 'checked_' + w[1]}.get(w[0], w[0])
    for kv in w[1:]:
        m = re.match(r'(typical_us|MBps)=([0-9.]+)$', kv)
        if m: vals.setdefault(name, []).append(float(m.group(2)))
med = {k: statistics.median(v) for k, v in vals.items() if v}
def row(label, g, p, unit, goal, higher):
    if g not in med or p not in med:
        print(f"| {label} | {med.get(g, 'n/a')} | {med.get(p, 'n/a')} | - | {goal} | not measured |"); return
    r = med[g] / med[p]
    m = re.match(r'([<>]=) ([0-9.]+)x', goal)
    status = '-' if not m else ('met' if (r >= float(m.group(2)) if m.group(1) == '>=' else r <= float(m.group(2))) else 'not met')
    print(f"| {label} | {med[g]:.2f} {unit} | {med[p]:.2f} {unit} | {r:.2f}x | {goal} | {status} |")
print("| measurement | gdr | perftest | ratio | goal | |")
print("| --- | --- | --- | --- | --- | --- |")
row("latency, 8 B send/recv vs ib_send_lat (t_typical, one-way)", 'gdr_send_lat', 'ib_send_lat', 'us', '<= 1.3x', False)
row("latency, 8 B put vs ib_write_lat (t_typical, one-way)", 'gdr_put_lat', 'ib_write_lat', 'us', '<= 1.1x', False)
row("latency, 8 B get vs ib_read_lat (t_typical, round trip)", 'gdr_get_lat', 'ib_read_lat', 'us', '<= 1.1x', False)
row("latency, 8 B fetch_add vs ib_atomic_lat (t_typical, round trip)", 'gdr_atomic_lat', 'ib_atomic_lat', 'us', '<= 1.1x', False)
row("latency, 8 B put, checked mode (served) vs ib_write_lat", 'checked_put_lat', 'ib_write_lat', 'us', '(kept beside)', False)
row("latency, 8 B fetch_add, checked mode (served) vs ib_atomic_lat", 'checked_atomic_lat', 'ib_atomic_lat', 'us', '(kept beside)', False)
row(f"bandwidth, 64 KiB send/recv (RDMA WRITE) vs ib_write_bw, {window} in flight", 'gdr_send_bw', 'ib_write_bw', 'MiB/s', '>= 0.9x', True)
row(f"bandwidth, 64 KiB put vs ib_write_bw -R, {window} in flight", 'gdr_put_bw', 'ib_write_bw_R', 'MiB/s', '>= 0.95x', True)
row(f"bandwidth, 64 KiB get vs ib_read_bw, {window} in flight", 'gdr_get_bw', 'ib_read_bw', 'MiB/s', '>= 0.95x', True)
row(f"bandwidth, 64 KiB get vs ib_read_bw -R, {window} in flight", 'gdr_get_bw', 'ib_read_bw_R', 'MiB/s', '>= 0.95x', True)
row(f"bandwidth, 64 KiB put vs ib_write_bw, {window} in flight", 'gdr_put_bw', 'ib_write_bw', 'MiB/s', '>= 0.95x', True)
row(f"bandwidth, 64 KiB put, checked mode (served) vs ib_write_bw -R", 'checked_put_bw', 'ib_write_bw_R', 'MiB/s', '(kept beside)', True)
row("bandwidth, batches of 512 blocks of 16 KiB (put_batch, one at a time) vs ib_write_bw -s 16384", 'gdr_batch_bw', 'ib_write_bw_16k', 'MiB/s', '>= 0.9x', True)
# Latency also as the median of each repetition's own ratio: both tools
# of one repetition ran back to back, so a slow stretch of the host moves both.
for g, p in (('gdr_send_lat', 'ib_send_lat'), ('gdr_put_lat', 'ib_write_lat'), ('gdr_get_lat', 'ib_read_lat'),
             ('gdr_atomic_lat', 'ib_atomic_lat')):
    if vals.get(g) and vals.get(p):
        pr = [a / b for a, b in zip(vals[g], vals[p])]
        print(f"paired {g} / {p}: median {statistics.median(pr):.3f} ({' '.join(f'{x:.2f}' for x in pr)})")
print("samples:", {k: v for k, v in vals.items()})
PY
rm -rf "$out"
