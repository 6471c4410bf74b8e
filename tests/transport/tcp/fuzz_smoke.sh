#!/bin/bash
# Short CI run of the frame parser fuzzer: builds it with clang's libFuzzer
# (ASan + UBSan) and runs 200000 inputs from the checked-in seeds.
# Skips (passes with a note) where clang or its fuzzer runtime is missing.
set -euo pipefail
src=$1
seeds=$(dirname "$2")
root=$(cd "$(dirname "$src")/../../.." && pwd)
work=${TEST_TMPDIR:-$(mktemp -d)}
if ! command -v clang++ >/dev/null; then
  echo "[gdr-skip] frame_fuzz_smoke: clang++ not installed"
  exit 0
fi
clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -Wall -Wextra -Werror -I"$root" "$src" -o "$work/frame_fuzz"
mkdir -p "$work/corpus"
cp "$seeds"/* "$work/corpus/"
"$work/frame_fuzz" -runs=200000 -seed=1 "$work/corpus" 2>&1 | tail -5
