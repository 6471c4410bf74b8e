#!/bin/bash
# gdr_perf still runs, from its command line to its CSV: a loopback and a
# TCP send, a TCP put and get, Pinned memory, a size range; and what it
# cannot run is refused with the reason and status 2. A few hundred
# operations each: this checks the tool, it measures nothing.
set -uo pipefail
bin=benchmarks/gdr_perf
tmp=${TEST_TMPDIR:-$(mktemp -d)}
fail=0
run() {  # name expected-csv-rows args...
  local name=$1 rows=$2
  shift 2
  if ! "$bin" "$@" --iters 50 --bw-reps 1 --vs none --plot "" --csv "$tmp/$name.csv" >"$tmp/$name.out" 2>"$tmp/$name.err"; then
    echo "FAILED: $name ($*):"; cat "$tmp/$name.out" "$tmp/$name.err"; fail=1; return
  fi
  local got
  got=$(($(wc -l <"$tmp/$name.csv") - 1))
  if [[ $got -ne $rows ]] || grep -q ',nan,' "$tmp/$name.csv" || ! grep -qE 'host-|shared-memory' "$tmp/$name.csv"; then
    echo "FAILED: $name: $got rows (want $rows), or a row without a measurement or a path:"; cat "$tmp/$name.csv"; fail=1
    return
  fi
  echo "ok: $name"; cat "$tmp/$name.out"
}
refused() {  # name expected-message args...
  local name=$1 want=$2
  shift 2
  "$bin" "$@" --csv "$tmp/$name.csv" >"$tmp/$name.out" 2>&1
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -q -- "$want" "$tmp/$name.out"; then
    echo "FAILED: $name: status $rc, output:"; cat "$tmp/$name.out"; fail=1; return
  fi
  echo "ok: $name refused: $(tail -1 "$tmp/$name.out")"
}
run loopback_send 2 --transport loopback --sizes 8,64K
run tcp_send 3 --sizes 8:32:x2
run tcp_put 2 --op put --sizes 8,64K
run tcp_get_pinned 2 --op get --space pinned --peer-space host --sizes 8,64K
run shm_send 2 --transport shm --sizes 8,1M
run shm_put 2 --transport shm --op put --sizes 8,64K
refused ipc "the shm transport.s Device path" --transport ipc
run tcp_fetch_add 1 --op fetch_add --sizes 8
refused fetch_add_device "host memory" --op fetch_add --peer-space device
refused bad_size "not a size" --sizes 8,lots
refused verbs_no_ip "IP address" --transport verbs --verbs-ip ""
exit $fail
