#!/bin/bash
# Runs the quickstart and checks that every step reported success.
set -euo pipefail
out=$(examples/quickstart)
echo "$out"
grep -q "checksum matches" <<<"$out"
grep -q "4. loopback: one message of 16 bytes" <<<"$out"
grep -q "got it back: equal" <<<"$out"
grep -q "runs past the window: remote access denied" <<<"$out"
grep -q "^done:" <<<"$out"
