#!/usr/bin/env bash
# Runs the verbs test binaries for real: inside one Soft-RoCE guest (QEMU,
# TCG, Debian's kernel with rdma_rxe), all binaries in one boot, each under
# a timeout. Outside the guest the same binaries skip (no RDMA device).
#
#   bash .ci/verbs-vm.sh BAZEL_BIN      # e.g. $(./bazelw info bazel-bin --config=ci)
#
# Needs root (apt-get, and qemu reading the host's root filesystem, which the
# guest mounts read-only: host-built binaries run there unchanged). The VM
# tool is tools/rxe/run-in-rxe-vm.sh (or $GDR_RXE_VM),
# which installs qemu, rdma-core's providers and perftest when missing.
#
# Output: each binary's log, then as the LAST line
#   verbs-vm: N passed, N failed, N skipped
# counted as .ci/run counts a test log (doctest's case summary; each
# `[gdr-skip]` line moves one case from passed to skipped; a binary without
# a summary, or that timed out, counts one failure). Exit status 0 unless
# the guest could not be started (then the last line counts one failure).
set -uo pipefail
bin=${1:?usage: verbs-vm.sh BAZEL_BIN}
vm=${GDR_RXE_VM:-$(cd "$(dirname "$0")/.." && pwd)/tools/rxe/run-in-rxe-vm.sh}
per_test=${GDR_VERBS_TEST_TIMEOUT:-150}
tests=(tests/verbs/conformance_test tests/verbs/staged_test tests/verbs/transport_test tests/verbs/connect_test tests/verbs/credits_test tests/verbs/grants_test tests/verbs/memory_test tests/verbs/gate_test tests/verbs/flush_test tests/verbs/recv_test tests/verbs/peer_kill_test tests/verbs/probe_test tests/verbs/gpudirect_test tests/verbs/gpudirect_path_test tests/verbs/mesh_test tests/verbs/one_sided_test tests/verbs/one_sided_kill_test tests/stress/stress_verbs_test)

out=$(mktemp -d /var/tmp/gdr-verbs-vm.XXXXXX)
trap 'rm -rf "$out"' EXIT
list=()
for t in "${tests[@]}"; do
  [[ -x $bin/$t ]] && list+=("$bin/$t") || echo "verbs-vm: $t not built, not run" >&2
done

if [[ ! -x $vm ]]; then
  echo "verbs-vm: no VM tool at $vm" >&2
  echo "verbs-vm: 0 passed, 1 failed, 0 skipped"
  exit 0
fi

# The guest runs this: every binary in turn, logs into the shared folder.
cat >"$out/guest.sh" <<'GUEST'
#!/bin/bash
out=$1; per=$2; shift 2
export GDR_VERBS_IP=$RXEVM_IP
i=0
for b in "$@"; do
  i=$((i + 1))
  start=$(date +%s)
  timeout "$per" "$b" >"$out/log.$i" 2>&1
  echo "rc=$? seconds=$(( $(date +%s) - start )) $b" >"$out/status.$i"
done
GUEST
chmod +x "$out/guest.sh"
t0=$SECONDS
"$vm" --rw "$out" --timeout $((per_test * ${#list[@]} + 60)) -- "$out/guest.sh" "$out" "$per_test" "${list[@]}" >&2
rc=$?
echo "verbs-vm: guest exited $rc after $((SECONDS - t0)) s" >&2

p=0 f=0 s=0
if [[ $rc -eq 125 ]]; then
  echo "verbs-vm: the guest or its RDMA device could not be set up" >&2
  f=1
fi
for i in $(seq 1 ${#list[@]}); do
  b=${list[$((i - 1))]}
  log=$out/log.$i
  if [[ ! -f $out/status.$i ]]; then
    [[ $rc -eq 125 ]] || { echo "verbs-vm: $b did not run" >&2; f=$((f + 1)); }
    continue
  fi
  echo "=== $(cat "$out/status.$i")" >&2
  tail -n 40 "$log" >&2
  summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -1)
  if [[ -z $summary ]] || ! grep -q '^rc=0 ' "$out/status.$i"; then
    if [[ -n $summary ]]; then
      read -r tp tf ts < <(sed -E 's/.*test cases: *[0-9]+ *\| *([0-9]+) passed *\| *([0-9]+) failed *\| *([0-9]+) skipped.*/\1 \2 \3/' <<<"$summary")
      p=$((p + tp)); f=$((f + (tf > 0 ? tf : 1))); s=$((s + ts))
    else
      f=$((f + 1))
    fi
    continue
  fi
  read -r tp tf ts < <(sed -E 's/.*test cases: *[0-9]+ *\| *([0-9]+) passed *\| *([0-9]+) failed *\| *([0-9]+) skipped.*/\1 \2 \3/' <<<"$summary")
  g=$(grep -c '^\[gdr-skip\]' "$log")
  tp=$((tp - g)); ((tp < 0)) && tp=0
  p=$((p + tp)); f=$((f + tf)); s=$((s + ts + g))
done
echo "verbs-vm: $p passed, $f failed, $s skipped"
exit 0
