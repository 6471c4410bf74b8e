#!/usr/bin/env bash
# gdr's verbs transport against perftest on the same Soft-RoCE link, in one
# guest, alternating (gdr, then perftest, per repetition), medians of REPS.
#
#   bash benchmarks/verbs/run.sh [VERBS_BENCH] [REPS]      # on the host, as root
#
# VERBS_BENCH is the built benchmark (default: bazel-bin's
# benchmarks/verbs/verbs_bench, built with -c opt). The guest comes from
# tools/rxe/run-in-rxe-vm.sh. Prints each measurement, then a table of
# medians and ratios (gdr / perftest).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
bench=${1:-$here/bazel-bin/benchmarks/verbs/verbs_bench}
reps=${2:-3}
bench=$(readlink -f "$bench")
[[ -x $bench ]] || { echo "run.sh: no benchmark at $bench (./bazelw build -c opt //benchmarks/verbs:verbs_bench)" >&2; exit 2; }
out=$(mktemp -d /var/tmp/gdr-verbs-bench.XXXXXX)
cat >"$out/guest.sh" <<'GUEST'
#!/bin/bash
# In the guest: $1 = benchmark, $2 = repetitions.
B=$1; R=$2; D=$RXEVM_DEV; G=$RXEVM_GID_INDEX; IP=$RXEVM_IP
pt() {  # perftest pair: server in the background, client retried until it connects
  local tool=$1; shift
  timeout 60 $tool -d $D -x $G "$@" >/dev/null 2>&1 &
  local s=$!
  for i in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.5
    if timeout 60 $tool -d $D -x $G "$@" $IP 2>/dev/null >/tmp/pt.out; then break; fi
  done
  wait $s 2>/dev/null || true
  cat /tmp/pt.out
}
for r in $(seq 1 $R); do
  echo "# repetition $r"
  timeout 60 $B $IP send_lat 8 1000
  echo "ib_send_lat $(pt ib_send_lat -s 8 -n 1000 | awk '$1 == 8 {print "typical_us=" $5 " avg_us=" $6}')"
  timeout 60 $B $IP put_lat 8 1000
  echo "ib_write_lat $(pt ib_write_lat -s 8 -n 1000 | awk '$1 == 8 {print "typical_us=" $5 " avg_us=" $6}')"
  timeout 120 $B $IP send_bw 65536 2000
  echo "ib_write_bw $(pt ib_write_bw -s 65536 -n 2000 | awk '$1 == 65536 {print "MBps=" $4}')"
  timeout 120 $B $IP put_bw 65536 1000
  echo "ib_write_bw_R $(pt ib_write_bw -R -s 65536 -n 2000 | awk '$1 == 65536 {print "MBps=" $4}')"
done
GUEST
chmod +x "$out/guest.sh"
"$here/tools/rxe/run-in-rxe-vm.sh" --timeout 1500 -- "$out/guest.sh" "$bench" "$reps" | tee "$out/raw.txt"
python3 - "$out/raw.txt" <<'PY'
import re, statistics, sys
vals = {}
for line in open(sys.argv[1]):
    w = line.split()
    if not w or w[0].startswith('#'): continue
    name = w[0] if w[0] != 'gdr-verbs' else 'gdr_' + w[1]
    for kv in w[1:]:
        m = re.match(r'(typical_us|MBps)=([0-9.]+)$', kv)
        if m: vals.setdefault(name, []).append(float(m.group(2)))
med = {k: statistics.median(v) for k, v in vals.items() if v}
def row(label, g, p, unit, goal, higher):
    if g not in med or p not in med:
        print(f"| {label} | {med.get(g, 'n/a')} | {med.get(p, 'n/a')} | - | {goal} | not measured |"); return
    r = med[g] / med[p]
    met = r >= 0.9 if higher else r <= 1.1
    print(f"| {label} | {med[g]:.2f} {unit} | {med[p]:.2f} {unit} | {r:.2f}x | {goal} | {'met' if met else 'not met'} |")
print("| measurement | gdr | perftest | ratio | goal | |")
print("| --- | --- | --- | --- | --- | --- |")
row("latency, 8 B send/recv vs ib_send_lat (t_typical)", 'gdr_send_lat', 'ib_send_lat', 'us', '<= 1.1x', False)
row("latency, 8 B put vs ib_write_lat (t_typical)", 'gdr_put_lat', 'ib_write_lat', 'us', '<= 1.1x', False)
row("bandwidth, 64 KiB send/recv (RDMA WRITE) vs ib_write_bw", 'gdr_send_bw', 'ib_write_bw', 'MB/s', '>= 0.9x', True)
row("bandwidth, 64 KiB put vs ib_write_bw -R", 'gdr_put_bw', 'ib_write_bw_R', 'MB/s', '>= 0.9x', True)
print("samples:", {k: v for k, v in vals.items()})
PY
rm -rf "$out"
