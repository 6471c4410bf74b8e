#!/usr/bin/env bash
# The GPUDirect data path's cost on one Soft-RoCE link, with host memory
# standing in for GPU memory (verbs_bench's GDR_BENCH_GPUDIRECT=1: the
# GPUDirect endpoints' real data path, no GPU needed), side by side with the
# host path and with perftest in one guest, alternating, medians of REPS.
#
#   bash benchmarks/verbs/gpudirect.sh [VERBS_BENCH] [REPS]   # on the host, as root
#
# What it shows: a Device send always goes by rendezvous (no CPU copy into
# an eager frame), so a small one pays the rts / rtr round trip before its
# RDMA WRITE; a large one moves as the host path does. No goal is set: no
# machine here has a GPU and an RDMA NIC to compare with perftest's
# --use_cuda.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
bench=${1:-$here/bazel-bin/benchmarks/verbs/verbs_bench}
reps=${2:-3}
bench=$(readlink -f "$bench")
[[ -x $bench ]] || { echo "gpudirect.sh: no benchmark at $bench (./bazelw build -c opt //benchmarks:verbs/verbs_bench)" >&2; exit 2; }
out=$(mktemp -d /var/tmp/gdr-verbs-gd.XXXXXX)
cat >"$out/guest.sh" <<'GUEST'
#!/bin/bash
# In the guest: $1 = benchmark, $2 = repetitions, $3 = the repository.
B=$1; R=$2; IP=$RXEVM_IP
source "$3/benchmarks/verbs/perftest_pair.sh"
for r in $(seq 1 $R); do
  echo "# repetition $r"
  timeout 60 $B $IP send_lat 8 1000
  GDR_BENCH_GPUDIRECT=1 timeout 60 $B $IP send_lat 8 1000
  echo "ib_send_lat $(pt ib_send_lat -s 8 -n 1000 | awk '$1 == 8 {print "typical_us=" $5}')"
  timeout 120 $B $IP send_bw 65536 2000
  GDR_BENCH_GPUDIRECT=1 timeout 120 $B $IP send_bw 65536 2000
  echo "ib_write_bw $(pt ib_write_bw -s 65536 -n 2000 -t 128 | awk '$1 == 65536 {print "MBps=" $4}')"
done
GUEST
chmod +x "$out/guest.sh"
"$here/tools/rxe/run-in-rxe-vm.sh" --timeout 1800 -- "$out/guest.sh" "$bench" "$reps" "$here" | tee "$out/raw.txt"
python3 - "$out/raw.txt" <<'PY'
import re, statistics, sys
vals = {}
for line in open(sys.argv[1]):
    w = line.split()
    if not w or w[0].startswith('#'): continue
    name = w[0] + ('_' + w[1] if w[0].startswith('gdr-verbs') else '')
    for kv in w[1:]:
        m = re.match(r'(typical_us|MBps)=([0-9.]+)$', kv)
        if m: vals.setdefault(name, []).append(float(m.group(2)))
med = {k: statistics.median(v) for k, v in vals.items() if v}
def row(label, a, b, unit):
    if a in med and b in med:
        print(f"| {label} | {med[a]:.2f} {unit} | {med[b]:.2f} {unit} | {med[a] / med[b]:.2f}x |")
    else:
        print(f"| {label} | {med.get(a, 'n/a')} | {med.get(b, 'n/a')} | - |")
print("| measurement | GPUDirect path (stand-in) | compared with | ratio |")
print("| --- | --- | --- | --- |")
row("8 B send latency vs gdr host send", 'gdr-verbs-gpudirect_send_lat', 'gdr-verbs_send_lat', 'us')
row("8 B send latency vs ib_send_lat", 'gdr-verbs-gpudirect_send_lat', 'ib_send_lat', 'us')
row("64 KiB send bandwidth vs gdr host send", 'gdr-verbs-gpudirect_send_bw', 'gdr-verbs_send_bw', 'MiB/s')
row("64 KiB send bandwidth vs ib_write_bw", 'gdr-verbs-gpudirect_send_bw', 'ib_write_bw', 'MiB/s')
print("samples:", vals)
PY
rm -rf "$out"
