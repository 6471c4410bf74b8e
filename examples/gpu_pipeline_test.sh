#!/bin/bash
# Runs the GPU pipeline with a few small messages. With a GPU both sides must
# report their throughput on the staged path and the consumer no mismatched
# word; without one it must say why. Either way it must exit 0.
set -euo pipefail
out=$(examples/gpu_pipeline --count 8 --size 1M)
echo "$out"
if grep -q "^gpu_pipeline: no GPU here" <<<"$out"; then exit 0; fi
grep -q "^producer: 8 messages .* GB/s, path staged-pinned$" <<<"$out"
grep -q "^consumer: 8 messages .* GB/s, path staged-pinned; 0 mismatched words$" <<<"$out"
