#!/usr/bin/env bash
# Device calls of session 18 (after `. bench/device_setup.sh`; logs also go to OUTDIR):
#   test:    GPU tests of the per-warp kernel and of the block table two tiles ahead, then the probe of the
#            per-warp kernel with one or two tiles of bytes ahead on the gpt-oss layer;
#   profile: Nsight Compute profiles at 128k (PROFILE_FORMATS, default turboquant_4bit_nc_gl).
set -u
out=${1:?usage: bash bench/device_tq_warp.sh OUTDIR test|profile}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "$2" = test ]; then
  timeout 240 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "per_warp or pages_one_tile" -p no:cacheprovider \
    > "$out/pytest.log" 2>&1; tail -5 "$out/pytest.log"
  timeout 200 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_4bit_nc,turboquant_k3v4_nc \
    --contexts 131072 --batch 1,8 --block-n 64 --per-warp 1 --pages-ahead 2 --bytes-ahead 1,2 --split-scale 1,2 \
    --out "$out/probe_gptoss_bytes.json" 2>&1 | grep -v picked > "$out/probe.log"; cat "$out/probe.log"
else
  for g in llama-3.1-8b gpt-oss-20b; do
    for pw in "" --per-warp; do
      PROFILE_TAG=_$g$pw PROFILE_ARGS="--context 131072 --geometry $g $pw" timeout 100 bash bench/profile_gpu.sh "$out" ${PROFILE_FORMATS:-turboquant_4bit_nc_gl}
    done
  done
fi
