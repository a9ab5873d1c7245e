#!/usr/bin/env bash
# The runtime's GPU figures in one go (README "Embedded runtime"): bench with --record and verify for the
# Llama-3.1-8B and gpt-oss-20b geometries, then the GPU-marked runtime tests. Results go to $OUT.
#   OUT=/tmp/kvp-gpu bash bench/runtime_gpu.sh
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
kvp() { python3 -m kvpolicy "$@"; }
kvp bench -m llama-3.1-8b --contexts 1k..128k --batch 1 --compare turboquant_4bit_nc \
    --record "$OUT/measured-h200.yaml" --out "$OUT"
kvp bench -m gpt-oss-20b --contexts 1k..128k --batch 1 --record "$OUT/measured-h200.yaml" --out "$OUT"
kvp verify -m llama-3.1-8b --contexts 4k..128k --compare fp8+one_level,turboquant_4bit_nc,turboquant_3bit_nc \
    --out "$OUT"
kvp verify -m gpt-oss-20b --contexts 4k..128k --compare fp8+one_level --out "$OUT"
for c in 4k 32k; do kvp recommend -m llama-3.1-8b -g auto -c $c --policy "$OUT/measured-h200.yaml" -f json |
    python3 -c "import json,sys; r=json.load(sys.stdin); e=r['estimates']; print('$c', r['decision']['kv_cache_dtype'], e['itl_slope_ratio'], e['break_even_tokens'])"; done
python3 -m pytest -q -rs -s tests/test_runtime_gpu.py
