# Sourced by the benchmarks' guest scripts (run.sh, gpudirect.sh) inside the
# Soft-RoCE guest: pt TOOL ARGS... runs a perftest pair on the guest's rxe
# device (RXEVM_DEV, RXEVM_GID_INDEX, RXEVM_IP): the server in the
# background, the client retried until it connects; prints the client's
# report.
pt() {
  local tool=$1; shift
  timeout 60 $tool -d $RXEVM_DEV -x $RXEVM_GID_INDEX "$@" >/dev/null 2>&1 &
  local s=$!
  for i in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.5
    if timeout 60 $tool -d $RXEVM_DEV -x $RXEVM_GID_INDEX "$@" $RXEVM_IP 2>/dev/null >/tmp/pt.out; then break; fi
  done
  wait $s 2>/dev/null || true
  cat /tmp/pt.out
}
