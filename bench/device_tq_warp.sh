#!/usr/bin/env bash
# Device calls of session 18 (after `. bench/device_setup.sh`; logs also go to OUTDIR):
#   test:    GPU tests of the per-warp kernel and of the block table one tile ahead (the probe of two
#            tiles of bytes ahead that followed is in bench/results_probe_tq_warp_bytes_ahead_h200.json;
#            that option is gone);
#   profile: Nsight Compute profiles at 128k (PROFILE_FORMATS, default turboquant_4bit_nc_gl);
#   final:   the evidence run (all rows, batch 8), the Gluon rows at batch 1, and k8v4 with the block
#            table one or two tiles ahead (set KVP_COMMIT to the commit measured);
#   v3:      GPU tests of the per-warp kernel with 3-bit values, then the probe of 3bit_nc in both kernels;
#   d64:     the per-warp kernel at head_dim 64 under register caps of 96 and 104 (5 and 4 programs per SM),
#            then the evidence run and the batch-1 Gluon rows of this code (set KVP_COMMIT);
#   tests:   the GPU tests of the TurboQuant kernels and of the runtime (338 tests, about 6 minutes);
# session 19:
#   lazy:    GPU tests of the per-warp kernel (the lazy max's lone-rising-head test included), the same test
#            with the rescale vote blind to each thread's second head (it must fail for head 1), then the
#            probe of the lazy against the exact max, pages one or two tiles ahead, both layers;
#   splits:  4bit_nc in the per-warp kernel with the lazy max at 0.5-4.125x the default split count;
#   waves:   the per-warp defaults at 64k and 128k, batch 8, with one wave of splits against two;
#   profile19: Nsight Compute profiles of the default (per-warp, lazy) 4bit_nc at 128k: gpt-oss batch 8
#            and 1, Llama batch 8;
#   (an `l2` mode probed an L2 prefetch of each warp's page two tiles ahead, on 91650d6:
#            bench/results_probe_tq_warp_l2_*_h200.json; within 1-2%, reverted, the option is gone);
#   evidence: the evidence run (all rows, batch 8) and the Gluon rows at batch 1, files tagged TAG.
# session 20:
#   ppw:     GPU tests of the per-warp kernel (one and two pages per warp), then the probe of two pages per
#            warp (128-token tiles) against one, both layers, 128k;
#   ppw2:    the probe of k3v4_nc with two pages per warp (lazy or exact max, both layers) and of 3bit_nc at
#            head_dim 64: the warpgroup kernel against two pages per warp, uncapped or capped at 168;
#   ppw4:    GPU tests of four pages per warp (head_dim 64), then the probe of four pages against the
#            two-page defaults on the gpt-oss layer, 128k.
# session 21:
#   fold:    GPU tests of the per-warp kernel (pytest-xdist from .whl), then the probe of the tile's pages
#            summed in-thread (kernels/tq_warp.py) under the register caps it makes room for, and the same
#            probe's default cases on the kernel before it (.ab/tq_warp_base.py, git-ignored: carry it);
#   sum:     the probe of TQGluonConfig.sum_pages off and on for each per-warp default (value rows as
#            immediates in both), and the same defaults on the kernel before both (.ab/tq_warp_base.py);
#   pw:      the GPU tests of the per-warp kernel (all of `-k per_warp`, about 7.5 minutes).
# session 22:
#   pwx:     the same on 4 pytest-xdist workers (PW_K: another -k expression).
#   rt:      the other GPU tests of the TurboQuant kernels and the runtime's (`-k "not per_warp"`), then the
#            evidence run (set KVP_COMMIT and TAG);
#   addr:    the probe of key and value rows as immediate offsets (3bit_nc with two and four pages on the
#            gpt-oss layer, every per-warp default on both layers), then the same cases on the kernel before
#            it (.ab/tq_warp_base.py: main's kernels/tq_warp.py at 3875264, git-ignored: carry it);
#   v3sel:   GPU tests of the per-warp kernel with 3bit_nc, the probe of its value program with one select per
#            two outputs against the kernel before it (.ab/tq_warp_base.py: ccfc049's kernels/tq_warp.py),
#            then the evidence run (set KVP_COMMIT and TAG).
# session 23:
#   profile23: Nsight Compute profiles of the four-page defaults at 128k with the memory tables: gpt-oss
#            batch 8 4bit_nc and 3bit_nc, batch 1 4bit_nc, Llama batch 8 3bit_nc.
#   unroll:  the probe of two tiles per loop iteration against one, both layers, and its GPU tests.
# session 24 (one warp per program and its shared-memory ring: mode onewarp at eb53980, reverted):
#   sums:    GPU tests of TQGluonConfig.mma_sums, then its probe against the defaults at 128k, both layers,
#            batch 8 and 1, one and two tiles per iteration (4bit_nc at head_dim 64 also capped at 168
#            registers: 3 programs per SM, with spills).
#   b1curve: gpt-oss batch 1 4bit_nc (the default) at 8k-128k with the default splits and half of them,
#            beside cuDNN: where the time per token changes.
# session 25:
#   rotate:  GPU tests of TQGluonConfig.rotate_query, then its probe (off / on) with each format's default
#            config, both layers, batch 1 and 8, 4k and 128k (gpt-oss 4bit_nc at 4k-128k), and gpt-oss batch-1
#            4bit_nc at 128k with 33 splits (fills the 264 program slots) against 32.
#   early:   GPU tests (rotate_query, four pages), then the probe of each format's default with the first
#            tile's loads before the query's prologue, rotate_query off / on, and the same cases on the kernel
#            before both (.ab/tq_warp_base.py: 9a75e12's kernels/tq_warp.py, git-ignored: carry it).
#   twopage: GPU tests of two pages per warp under a cap of 128 registers, then the probe on the gpt-oss layer
#            (128k, batch 8 and 1) of two pages per warp with the sums by mma.sync, one or two tiles per
#            iteration, uncapped (145-160 registers: 3 programs per SM) or capped at 128 (4), against each
#            format's default (four pages, 2 programs per SM).
# session 26:
#   warporder: GPU tests of the pages in the per-warp kernel's order (turboquant.warp_plane_order: the
#            per-warp kernel's paths, the warpgroup kernel's k8v4 cases, the store), then the probe of each
#            format's default on both layers (4k and 128k, batch 8 and 1), with the alternatives its fewer
#            registers open on the gpt-oss layer, and the same defaults on the kernels before it
#            (.ab/base_kernels/: 048d9b5's kernels/*.py, git-ignored: carry it). The probes' JSON files go
#            into one tarball (the device returns at most 8 files).
#   keylane: GPU tests of the defaults (agrees, rotate_query), then the defaults of 4bit_nc and 3bit_nc on the
#            gpt-oss layer (128k, batch 8 and 1) with the key blocks at each lane's place, and the same on the
#            kernels before it (.ab/base_kernels/: 24c72bb's kernels/*.py, git-ignored: carry it).
#   offsets: GPU tests (the 64-bit offsets past 8 GiB, agrees, rotating, needle), then the defaults of the three
#            per-warp formats at 128k (gpt-oss batch 8 and 1, Llama batch 8) with int32 page offsets, the integer
#            3-bit key table and qf in the exponent's FFMA, and the same on the kernels before them
#            (.ab/base_kernels/: 15b8c77's kernels/*.py, git-ignored: carry it).
# session 28:
#   floor:   where a batch-1 step's time goes (bench/probe_tq_floor.py: the call, the kernel alone, the kernel
#            and an empty second launch, the merge alone, an empty launch; gpt-oss 4bit_nc and 3bit_nc at
#            4k-128k, Llama 3bit_nc at 4k and 128k), then the two-page form (128-token tiles) of k3v4_nc and
#            3bit_nc on the gpt-oss layer, uncapped or capped at 128, one or two tiles per iteration, with the
#            default split count and 1.5x it (3 programs per SM: 48 splits at batch 1), beside the defaults.
#   (a `pdl` mode tested and probed TQGluonConfig.pdl, programmatic dependent launch of the per-warp kernel and
#            its merge, on 347a7ce: bench/results_tq_floor/probe_pdl.log; no gain, reverted, the option is gone).
#   k8v4:    k8v4 (the warpgroup kernel) on the gpt-oss layer at 128k, batch 1 and 8: 64- or 128-token tiles,
#            uncapped or capped at 128 registers, 0.5-2x the default split count.
# session 29:
#   fused:   GPU tests of TQGluonConfig.fused_merge (-k fused), then bench/probe_tq_floor.py --fused: the
#            per-warp defaults with the split merge in the kernel between two plain calls, gpt-oss 4bit_nc,
#            k3v4_nc and 3bit_nc at 4k-128k, Llama 4bit_nc and 3bit_nc at 4k and 128k, batch 1 and 8.
#   unroll3: 3bit_nc on the gpt-oss layer, four pages per warp, one or two tiles per iteration (582 against 626
#            instructions per tile with the pages in thread order), 4k and 128k, batch 8 and 1.
# session 31 (bench/results_tq_stamps/):
#   stamps:  GPU tests of the probe's timer reads (-k stamps) and of the fused merge, then bench/probe_tq_stamps.py:
#            the per-warp defaults' programs timed from inside (global timer at entry, seq_len, the query's loads
#            and product, the prologue, the loop's end, the split count, the split merge): gpt-oss 4bit_nc and
#            3bit_nc at batch 1 (4k, 16k, 128k) and batch 8 (16k: batch 1's tiles per program at 128k; 128k),
#            Llama 3bit_nc at batch 1.
#   raw:     the same probe's last run whole (every program's stamps and SM), gpt-oss 4bit_nc at 128k, batch 1
#            and 8: which programs end late.
# session 32 (run as `waves` and `waves2` on branch tq-waves, renamed: session 19's `waves` is above):
#   firstwave:  GPU tests of TQGluonConfig.first_wave_weight and the stamps, then the probe of first-wave
#            weights 1.125-1.375 against the defaults (then 1.0), both layers, batch 1 and 8, 128k.
#   firstwave2: the first-wave GPU tests (-n 8), then weights 1.125 and 1.25 against the defaults for the
#            3-bit-key formats at batch 8, 64k and 128k, both layers (firstwave found 3bit_nc 5% faster there).
#            Results: bench/results_tq_stamps/waves*.
#   (modes run on branch tq-stamps-exp and removed with its knobs: `stamps2` (the query's stamps, rotated in the
#            kernel or before it), `prologue` (TQGluonConfig.interleave and pages_first, a branch that kept the
#            query's product after the first tile's loads), `stagger` (split s started (s mod 4) x 250-1000 ns
#            late): stamps_rotate.*, prologue*, stagger* in bench/results_tq_stamps/.)
set -u
out=${1:?usage: bash bench/device_tq_warp.sh OUTDIR test|profile|final|v3|d64|tests|lazy|splits|evidence|waves|profile19|ppw|ppw2|ppw4|fold|sum|pw|rt|addr|v3sel|profile23|unroll|sums|b1curve|rotate|early|twopage|warporder|unroll3|keylane|offsets|pwx|floor|k8v4|fused|stamps|raw|firstwave|firstwave2}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
gl=turboquant_k8v4_gl,turboquant_4bit_nc_gl,turboquant_k3v4_nc_gl,turboquant_3bit_nc_gl
logged_probe() {  # LOG TAG PROBE_ARGS...: one probe into $out/probe_TAG.json, its lines appended to $out/LOG
  local log=$1 tag=$2; shift 2
  echo "== $tag $*" >> "$out/$log"
  timeout "${PROBE_LIMIT:-120}" python3 bench/probe_tq_gluon.py "$@" --out "$out/probe_$tag.json" 2>&1 | grep -v picked >> "$out/$log"
}
use_base() {  # the kernel before the change (.ab/tq_warp_base.py, git-ignored: carry it); use_new undoes it
  cp kernels/tq_warp.py "$out/tq_warp_new.py"; cp .ab/tq_warp_base.py kernels/tq_warp.py
}
use_new() { cp "$out/tq_warp_new.py" kernels/tq_warp.py; rm "$out/tq_warp_new.py"; }
use_base_kernels() {  # all of kernels/*.py before the change (.ab/base_kernels/, git-ignored: carry it)
  mkdir -p "$out/kernels_new"; cp kernels/*.py "$out/kernels_new/"; cp .ab/base_kernels/*.py kernels/
}
use_new_kernels() { cp "$out/kernels_new"/*.py kernels/; rm -r "$out/kernels_new"; }
evidence_run() {  # TAG: the evidence run (every row, batch 8) and the Gluon rows at batch 1
  timeout 360 python3 bench/bench_decode.py --formats bf16,fp8,fp8_gl,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,$gl,sdpa_cudnn \
    --contexts 4096,16384,65536,131072 --batch 8 --skip-accuracy --evidence "$out/evidence.yaml" \
    --out "$out/results_decode_h200_evidence_$1.json" > "$out/results_decode_h200_evidence_$1.log" 2>&1
  grep -E "gl: |TB/s" "$out/results_decode_h200_evidence_$1.log" | tail -24
  timeout 100 python3 bench/bench_decode.py --formats sdpa_cudnn,fp8_gl,$gl --contexts 4096,16384,65536,131072 --batch 1 \
    --skip-accuracy --out "$out/results_decode_h200_tq_gluon_$1.json" > "$out/results_decode_h200_tq_gluon_$1.log" 2>&1
  grep -E "gl: " "$out/results_decode_h200_tq_gluon_$1.log" | tail -12
}
if [ "$2" = stamps ]; then
  timeout 200 python3 -m pytest -q -n 4 tests/kernels/test_tq_gluon.py -k "stamps or (fused and 4bit)" \
    -p no:cacheprovider > "$out/pytest_stamps.log" 2>&1; tail -3 "$out/pytest_stamps.log"
  { timeout 150 python3 bench/probe_tq_stamps.py --contexts 4096,16384,131072 --batch 1 --runs 20 --out "$out/final_b1.json"
    timeout 100 python3 bench/probe_tq_stamps.py --contexts 16384,131072 --batch 8 --runs 10 --out "$out/final_b8.json"
    timeout 60 python3 bench/probe_tq_stamps.py --geometries llama-3.1-8b --formats turboquant_3bit_nc \
      --contexts 131072 --batch 1 --runs 20 --out "$out/final_llama.json"; } > "$out/final.log" 2>&1
  cat "$out/final.log"
elif [ "$2" = raw ]; then
  timeout 200 python3 bench/probe_tq_stamps.py --formats turboquant_4bit_nc --contexts 131072 --batch 1,8 --runs 4 --raw \
    --out "$out/raw.json" 2>&1 | grep "graph call"
elif [ "$2" = firstwave ]; then
  timeout 240 python3 -m pytest -q -n 4 tests/kernels/test_tq_gluon.py -k "first_wave or stamps" -p no:cacheprovider \
    > "$out/pytest_waves.log" 2>&1; tail -3 "$out/pytest_waves.log"
  v="first_wave_weight=1.125/first_wave_weight=1.25/first_wave_weight=1.375"
  { timeout 150 python3 bench/probe_tq_stamps.py --contexts 131072 --batch 1,8 --runs 10 --variants $v --out "$out/waves_gpt.json"
    timeout 120 python3 bench/probe_tq_stamps.py --geometries llama-3.1-8b --contexts 131072 --batch 1,8 --runs 10 \
      --variants $v --out "$out/waves_llama.json"; } > "$out/waves.log" 2>&1
  grep -E "graph call|Error|error" "$out/waves.log"
elif [ "$2" = firstwave2 ]; then
  timeout 300 python3 -m pytest -q -n 8 tests/kernels/test_tq_gluon.py -k "first_wave" -p no:cacheprovider \
    > "$out/pytest_waves2.log" 2>&1; tail -3 "$out/pytest_waves2.log"
  v="first_wave_weight=1.125/first_wave_weight=1.25"
  for g in gpt-oss-20b llama-3.1-8b; do
    timeout 130 python3 bench/probe_tq_stamps.py --geometries $g --formats turboquant_3bit_nc,turboquant_k3v4_nc \
      --contexts 65536,131072 --batch 8 --runs 6 --variants $v --out "$out/waves2_$g.json"
  done > "$out/waves2.log" 2>&1
  grep -E "graph call|Error|error" "$out/waves2.log"
elif [ "$2" = test ]; then
  timeout 240 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "per_warp or pages_one_tile" -p no:cacheprovider \
    > "$out/pytest.log" 2>&1; tail -5 "$out/pytest.log"
elif [ "$2" = final ]; then
  evidence_run tq12  # session 18 ran this before the names were unified: its batch-1 files are ..._tq_gluon12
  timeout 60 python3 bench/probe_tq_gluon.py --formats turboquant_k8v4 --contexts 131072 --batch 1,8 \
    --block-n 64,128 --pages-ahead 1,2 --split-scale 1,2 --out "$out/probe_k8v4_pages.json" 2>&1 | grep -v picked > "$out/probe.log"
  tail -12 "$out/probe.log"
elif [ "$2" = v3 ]; then
  timeout 200 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "per_warp and 3bit" -p no:cacheprovider \
    > "$out/pytest.log" 2>&1; tail -5 "$out/pytest.log"
  timeout 240 python3 bench/probe_tq_gluon.py --formats turboquant_3bit_nc --contexts 131072 --batch 1,8 \
    --block-n 64 --per-warp 0,1 --maxnreg 0,128 --pages-ahead 2 --split-scale 1,2 \
    --out "$out/probe_3bit_per_warp.json" 2>&1 | grep -v picked > "$out/probe.log"; cat "$out/probe.log"
elif [ "$2" = d64 ]; then
  timeout 60 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_4bit_nc,turboquant_k3v4_nc \
    --contexts 131072 --batch 1,8 --block-n 64 --per-warp 1 --maxnreg 0,96,104 --pages-ahead 2 --split-scale 1,2 \
    --out "$out/probe_d64_caps.json" 2>&1 | grep -v picked > "$out/probe.log"; cat "$out/probe.log"
  evidence_run tq13  # likewise ..._tq_gluon13 in session 18
  grep -E "^\| 131072" "$out"/results_decode_h200_*tq13.log
elif [ "$2" = lazy ]; then
  timeout 200 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "per_warp" -p no:cacheprovider \
    > "$out/pytest.log" 2>&1; tail -3 "$out/pytest.log"
  cp kernels/tq_warp.py "$out/tq_warp.py.orig"
  sed -i 's/setp.neu.or.f32 p, ${2 \* n + 1}/setp.neu.or.f32 p, ${2 * n}/' kernels/tq_warp.py
  grep -c 'setp.neu.or.f32 p, ${2 \* n}' kernels/tq_warp.py
  timeout 60 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "lone_rising_head" -p no:cacheprovider \
    > "$out/pytest_mutant.log" 2>&1; grep -E "passed|failed" "$out/pytest_mutant.log" | tail -3; grep FAILED "$out/pytest_mutant.log"
  cp "$out/tq_warp.py.orig" kernels/tq_warp.py
  p="--contexts 131072 --batch 1,8 --block-n 64 --per-warp 1 --lazy 0,1 --split-scale 1"
  timeout 150 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b --formats turboquant_4bit_nc,turboquant_k3v4_nc \
    $p --maxnreg 128 --pages-ahead 1,2 --out "$out/probe_lazy_llama.json" 2>&1 | grep -v picked > "$out/probe_llama.log"
  timeout 80 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b --formats turboquant_3bit_nc \
    $p --maxnreg 0 --pages-ahead 2 --out "$out/probe_lazy_llama3.json" 2>&1 | grep -v picked > "$out/probe_llama3.log"
  timeout 120 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc \
    $p --maxnreg 0 --pages-ahead 2 --out "$out/probe_lazy_gptoss.json" 2>&1 | grep -v picked > "$out/probe_gptoss.log"
  cat "$out"/probe_*.log
elif [ "$2" = splits ]; then
  p="--formats turboquant_4bit_nc --contexts 131072 --batch 1,8 --block-n 64 --per-warp 1 --lazy 1 --split-scale 0.5,1,2,4.125"
  timeout 120 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b $p --maxnreg 128 --pages-ahead 1 \
    --out "$out/probe_splits_llama.json" 2>&1 | grep -v picked > "$out/probe_llama.log"
  timeout 120 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b $p --maxnreg 0 --pages-ahead 2 \
    --out "$out/probe_splits_gptoss.json" 2>&1 | grep -v picked > "$out/probe_gptoss.log"
  cat "$out"/probe_*.log
elif [ "$2" = ppw ]; then
  timeout 330 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "per_warp" -p no:cacheprovider \
    > "$out/pytest_ppw.log" 2>&1; tail -3 "$out/pytest_ppw.log"
  p="--contexts 131072 --batch 1,8 --per-warp 1 --split-scale 1,2"
  timeout 70 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_4bit_nc $p --lazy 1 \
    --block-n 64,128 --maxnreg 0,128 --pages-ahead 2 --out "$out/probe_ppw_gptoss4.json" 2>&1 | grep -v picked > "$out/probe_1.log"
  timeout 60 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_k3v4_nc $p --lazy 0 \
    --block-n 64,128 --maxnreg 0,136 --pages-ahead 2 --out "$out/probe_ppw_gptoss3.json" 2>&1 | grep -v picked > "$out/probe_2.log"
  timeout 50 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b --formats turboquant_4bit_nc $p --lazy 1 \
    --block-n 64,128 --maxnreg 128 --pages-ahead 1 --out "$out/probe_ppw_llama4.json" 2>&1 | grep -v picked > "$out/probe_3.log"
  timeout 50 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b --formats turboquant_4bit_nc,turboquant_3bit_nc $p \
    --lazy 1 --block-n 128 --maxnreg 0 --pages-ahead 2 --out "$out/probe_ppw_llama_uncapped.json" 2>&1 | grep -v picked > "$out/probe_4.log"
  cat "$out"/probe_*.log
elif [ "$2" = ppw2 ]; then
  p="--contexts 131072 --batch 1,8 --split-scale 1,2"
  timeout 120 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b,gpt-oss-20b --formats turboquant_k3v4_nc $p \
    --per-warp 1 --lazy 0,1 --block-n 128 --maxnreg 0 --pages-ahead 2 --out "$out/probe_ppw2_k3v4.json" 2>&1 | grep -v picked > "$out/probe_1.log"
  timeout 60 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_3bit_nc $p \
    --per-warp 0 --block-n 64 --maxnreg 0 --pages-ahead 2 --out "$out/probe_ppw2_3bit_wg.json" 2>&1 | grep -v picked > "$out/probe_2.log"
  timeout 100 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_3bit_nc $p \
    --per-warp 1 --block-n 128 --maxnreg 0,168 --pages-ahead 2 --out "$out/probe_ppw2_3bit_pw.json" 2>&1 | grep -v picked > "$out/probe_3.log"
  cat "$out"/probe_*.log
elif [ "$2" = ppw4 ]; then
  timeout 100 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "four_pages" -p no:cacheprovider \
    > "$out/pytest_ppw4.log" 2>&1; tail -3 "$out/pytest_ppw4.log"
  p="--geometries gpt-oss-20b --contexts 131072 --batch 1,8 --per-warp 1 --lazy 1 --split-scale 1,2 --pages-ahead 2"
  timeout 50 python3 bench/probe_tq_gluon.py --formats turboquant_4bit_nc $p --block-n 128 --maxnreg 128 \
    --out "$out/probe_ppw4_4bit_2pages.json" 2>&1 | grep -v picked > "$out/probe_1.log"
  timeout 50 python3 bench/probe_tq_gluon.py --formats turboquant_4bit_nc $p --block-n 256 --maxnreg 0 \
    --out "$out/probe_ppw4_4bit_4pages.json" 2>&1 | grep -v picked > "$out/probe_2.log"
  timeout 60 python3 bench/probe_tq_gluon.py --formats turboquant_k3v4_nc $p --block-n 128,256 --maxnreg 0 \
    --out "$out/probe_ppw4_k3v4.json" 2>&1 | grep -v picked > "$out/probe_3.log"
  cat "$out"/probe_*.log
elif [ "$2" = fold ]; then
  timeout 240 python3 -m pytest -q -n 8 tests/kernels/test_tq_gluon.py -k "per_warp" -p no:cacheprovider \
    > "$out/pytest_fold.log" 2>&1; tail -3 "$out/pytest_fold.log"
  p="--contexts 131072 --batch 1,8 --per-warp 1 --lazy 1 --split-scale 1,2 --pages-ahead 2"
  g=gpt-oss-20b l=llama-3.1-8b f4=turboquant_4bit_nc,turboquant_k3v4_nc f3=turboquant_3bit_nc
  logged_probe probe_fold.log fold_g4 --geometries $g --formats $f4 --block-n 256 --maxnreg 0,168 $p
  logged_probe probe_fold.log fold_g3 --geometries $g --formats $f3 --block-n 128,256 --maxnreg 0 $p
  logged_probe probe_fold.log fold_l --geometries $l --formats $f4,$f3 --block-n 128 --maxnreg 0,168 $p
  use_base
  logged_probe probe_fold.log base_g --geometries $g --formats $f4 --block-n 256 --maxnreg 0 $p
  logged_probe probe_fold.log base_g3 --geometries $g --formats $f3 --block-n 128 --maxnreg 0 $p
  logged_probe probe_fold.log base_l --geometries $l --formats $f4,$f3 --block-n 128 --maxnreg 0 $p
  use_new
  grep -E "^==|gl |b[18] " "$out/probe_fold.log"
elif [ "$2" = sum ]; then
  p="--contexts 131072 --batch 1,8 --per-warp 1 --lazy 1 --pages-ahead 2 --maxnreg 0"
  g=gpt-oss-20b l=llama-3.1-8b f4=turboquant_4bit_nc,turboquant_k3v4_nc f3=turboquant_3bit_nc
  logged_probe probe_sum.log sum_g4 --geometries $g --formats $f4 --block-n 256 --sum-pages 0,1 --split-scale 1 $p
  logged_probe probe_sum.log sum_g3 --geometries $g --formats $f3 --block-n 128 --sum-pages 0,1 --split-scale 1,1.5 $p
  logged_probe probe_sum.log sum_l --geometries $l --formats $f4,$f3 --block-n 128 --sum-pages 0,1 --split-scale 1 $p
  use_base  # its tq_warp.py ignores TQGluonConfig.sum_pages: --sum-pages 0 is the kernel as it was
  logged_probe probe_sum.log sbase_g4 --geometries $g --formats $f4 --block-n 256 --sum-pages 0 --split-scale 1 $p
  logged_probe probe_sum.log sbase_g3 --geometries $g --formats $f3 --block-n 128 --sum-pages 0 --split-scale 1 $p
  logged_probe probe_sum.log sbase_l --geometries $l --formats $f4,$f3 --block-n 128 --sum-pages 0 --split-scale 1 $p
  use_new
  grep -E "^==|gl |b[18] " "$out/probe_sum.log"
elif [ "$2" = pw ]; then
  timeout 560 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "per_warp" -p no:cacheprovider \
    > "$out/pytest_pw.log" 2>&1; tail -3 "$out/pytest_pw.log"
elif [ "$2" = pwx ]; then
  # the per-warp GPU tests on 4 workers (pytest-xdist from .whl/): the compiles run side by side
  timeout 540 python3 -m pytest -q -n 4 tests/kernels/test_tq_gluon.py -k "${PW_K:-per_warp}" -p no:cacheprovider \
    > "$out/pytest_pwx.log" 2>&1; tail -3 "$out/pytest_pwx.log"
elif [ "$2" = rt ]; then
  timeout 420 python3 -m pytest -q tests/kernels/test_tq_gluon.py tests/kernels/test_tq_store.py tests/test_runtime_gpu.py \
    -k "not per_warp" -p no:cacheprovider > "$out/pytest_rt.log" 2>&1; tail -3 "$out/pytest_rt.log"
  evidence_run "${TAG:?set TAG, e.g. tq18}"
elif [ "$2" = addr ]; then
  p="--contexts 131072 --batch 1,8 --per-warp 1 --lazy 1 --pages-ahead 2 --maxnreg 0"
  g=gpt-oss-20b l=llama-3.1-8b f4=turboquant_4bit_nc,turboquant_k3v4_nc f3=turboquant_3bit_nc
  logged_probe probe_addr.log addr_g3 --geometries $g --formats $f3 --block-n 128,256 --sum-pages 1 --split-scale 1 $p
  logged_probe probe_addr.log addr_g4 --geometries $g --formats $f4 --block-n 256 --sum-pages 1 --split-scale 1,1.5 $p
  logged_probe probe_addr.log addr_l --geometries $l --formats $f4,$f3 --block-n 128 --sum-pages 1 --split-scale 1 $p
  use_base
  logged_probe probe_addr.log abase_g3 --geometries $g --formats $f3 --block-n 128 --sum-pages 0 --split-scale 1 $p
  logged_probe probe_addr.log abase_g4 --geometries $g --formats $f4 --block-n 256 --sum-pages 1 --split-scale 1 $p
  logged_probe probe_addr.log abase_l --geometries $l --formats $f4,$f3 --block-n 128 --sum-pages 1 --split-scale 1 $p
  use_new
  grep -E "^==|gl |b[18] " "$out/probe_addr.log"
elif [ "$2" = v3sel ]; then
  timeout 220 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "per_warp and 3bit" -p no:cacheprovider \
    > "$out/pytest_v3sel.log" 2>&1; tail -3 "$out/pytest_v3sel.log"
  p="--formats turboquant_3bit_nc --contexts 131072 --batch 1,8 --per-warp 1 --lazy 1 --pages-ahead 2 --maxnreg 0 --split-scale 1 --sum-pages 1"
  logged_probe probe_v3sel.log v3sel_g --geometries gpt-oss-20b --block-n 256 $p
  logged_probe probe_v3sel.log v3sel_l --geometries llama-3.1-8b --block-n 128 $p
  use_base
  logged_probe probe_v3sel.log v3base_g --geometries gpt-oss-20b --block-n 256 $p
  logged_probe probe_v3sel.log v3base_l --geometries llama-3.1-8b --block-n 128 $p
  use_new
  grep -E "^==|gl |b[18] " "$out/probe_v3sel.log"
  evidence_run "${TAG:?set TAG, e.g. tq19}"
elif [ "$2" = evidence ]; then
  evidence_run "${TAG:?set TAG, e.g. tq14}"
elif [ "$2" = waves ]; then
  p="--contexts 65536,131072 --batch 8 --block-n 64 --per-warp 1 --split-scale 1,2"
  timeout 100 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b --formats turboquant_4bit_nc $p --lazy 1 --maxnreg 128 \
    --pages-ahead 1 --out "$out/probe_waves_llama4.json" 2>&1 | grep -v picked > "$out/probe_1.log"
  timeout 100 python3 bench/probe_tq_gluon.py --geometries llama-3.1-8b --formats turboquant_k3v4_nc $p --lazy 0 --maxnreg 128 \
    --pages-ahead 1 --out "$out/probe_waves_llama3.json" 2>&1 | grep -v picked > "$out/probe_2.log"
  timeout 100 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_4bit_nc $p --lazy 1 --maxnreg 0 \
    --pages-ahead 2 --out "$out/probe_waves_gptoss4.json" 2>&1 | grep -v picked > "$out/probe_3.log"
  timeout 100 python3 bench/probe_tq_gluon.py --geometries gpt-oss-20b --formats turboquant_k3v4_nc $p --lazy 0 --maxnreg 0 \
    --pages-ahead 2 --out "$out/probe_waves_gptoss3.json" 2>&1 | grep -v picked > "$out/probe_4.log"
  cat "$out"/probe_*.log
elif [ "$2" = profile19 ]; then
  for c in "gpt-oss-20b 8" "gpt-oss-20b 1" "llama-3.1-8b 8"; do
    set -- $c
    PROFILE_TAG=_s19_$1_b$2 PROFILE_ARGS="--context 131072 --geometry $1 --batch $2" timeout 150 bash bench/profile_gpu.sh "$out" turboquant_4bit_nc_gl
  done
elif [ "$2" = profile23 ]; then
  for c in "gpt-oss-20b 8 4bit_nc" "gpt-oss-20b 8 3bit_nc" "gpt-oss-20b 1 4bit_nc" "llama-3.1-8b 8 3bit_nc"; do
    set -- $c
    NCU_SECTIONS="--section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section InstructionStats" \
      PROFILE_TAG=_s23_$1_b$2 PROFILE_ARGS="--context 131072 --geometry $1 --batch $2" \
      timeout 140 bash bench/profile_gpu.sh "$out" turboquant_$3_gl
  done
elif [ "$2" = unroll ]; then
  tq=turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc
  common="--contexts 131072 --batch 8,1 --per-warp 1 --sum-pages 1 --unroll 0,1 --split-scale 1"
  logged_probe probe_unroll.log unroll_gptoss --formats $tq --geometries gpt-oss-20b --block-n 256 $common
  logged_probe probe_unroll.log unroll_llama --formats $tq --geometries llama-3.1-8b --block-n 128 $common
  grep -v "^==" "$out/probe_unroll.log" | grep -E "unroll=|us,"
  timeout 240 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k unrolled -p no:cacheprovider > "$out/pytest_unroll.log" 2>&1
  tail -3 "$out/pytest_unroll.log"
elif [ "$2" = sums ]; then
  timeout 300 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "mma_sums or lone_rising" -p no:cacheprovider \
    > "$out/pytest_sums.log" 2>&1
  tail -3 "$out/pytest_sums.log"
  tq=turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc
  c="--contexts 131072 --batch 8,1 --per-warp 1 --sum-pages 1 --mma-sums 0,1 --unroll 0,1 --split-scale 1"
  PROBE_LIMIT=150 logged_probe probe_sums.log sums_gptoss --formats $tq --geometries gpt-oss-20b --block-n 256 $c
  PROBE_LIMIT=150 logged_probe probe_sums.log sums_llama --formats $tq --geometries llama-3.1-8b --block-n 128 $c
  logged_probe probe_sums.log sums_cap --formats turboquant_4bit_nc --geometries gpt-oss-20b --block-n 256 \
    --contexts 131072 --batch 8 --per-warp 1 --sum-pages 1 --mma-sums 1 --unroll 1 --maxnreg 168 --split-scale 1
  grep -v "^==" "$out/probe_sums.log" | grep -E " us |us,"
elif [ "$2" = b1curve ]; then
  PROBE_LIMIT=200 logged_probe probe_b1curve.log b1curve --formats turboquant_4bit_nc --geometries gpt-oss-20b \
    --batch 1 --contexts 8192,16384,32768,65536,98304,131072 --block-n 256 --per-warp 1 --sum-pages 1 \
    --unroll 1 --mma-sums 1 --split-scale 0.5,1
  grep -v "^==" "$out/probe_b1curve.log" | grep -E " us |us,"
elif [ "$2" = rotate ]; then
  timeout 240 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k rotating -p no:cacheprovider \
    > "$out/pytest_rotate.log" 2>&1
  tail -3 "$out/pytest_rotate.log"
  c="--per-warp 1 --sum-pages 1 --rotate 0,1 --split-scale 1"
  PROBE_LIMIT=150 logged_probe probe_rotate.log rot_g4 --formats turboquant_4bit_nc --geometries gpt-oss-20b \
    --block-n 256 --unroll 1 --mma-sums 1 --contexts 4096,16384,65536,131072 --batch 1,8 $c
  logged_probe probe_rotate.log rot_gk --formats turboquant_k3v4_nc --geometries gpt-oss-20b --block-n 256 \
    --unroll 1 --mma-sums 0 --contexts 4096,131072 --batch 1,8 $c
  logged_probe probe_rotate.log rot_g3 --formats turboquant_3bit_nc --geometries gpt-oss-20b --block-n 256 \
    --unroll 0 --mma-sums 0 --contexts 4096,131072 --batch 1,8 $c
  PROBE_LIMIT=150 logged_probe probe_rotate.log rot_l --formats turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc \
    --geometries llama-3.1-8b --block-n 128 --unroll 1 --mma-sums 1 --contexts 4096,131072 --batch 1,8 $c
  logged_probe probe_rotate.log split33 --formats turboquant_4bit_nc --geometries gpt-oss-20b --block-n 256 \
    --unroll 1 --mma-sums 1 --contexts 131072 --batch 1 --per-warp 1 --sum-pages 1 --rotate 1 --split-scale 1,1.04
  grep -v "^==" "$out/probe_rotate.log" | grep -E " us |us,"
elif [ "$2" = early ]; then
  timeout 200 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "rotating or four_pages" -p no:cacheprovider \
    > "$out/pytest_early.log" 2>&1
  tail -3 "$out/pytest_early.log"
  early_probes() {  # TAG ROTATE
    local c="--per-warp 1 --sum-pages 1 --rotate $2 --split-scale 1 --batch 1,8"
    logged_probe probe_early.log $1_g4 --formats turboquant_4bit_nc --geometries gpt-oss-20b \
      --block-n 256 --unroll 1 --mma-sums 1 --contexts 4096,16384,65536,131072 $c
    logged_probe probe_early.log $1_gk --formats turboquant_k3v4_nc --geometries gpt-oss-20b --block-n 256 \
      --unroll 1 --mma-sums 0 --contexts 4096,131072 $c
    logged_probe probe_early.log $1_g3 --formats turboquant_3bit_nc --geometries gpt-oss-20b --block-n 256 \
      --unroll 0 --mma-sums 0 --contexts 4096,131072 $c
    logged_probe probe_early.log $1_l --formats turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc \
      --geometries llama-3.1-8b --block-n 128 --unroll 1 --mma-sums 1 --contexts 4096,131072 $c
  }
  early_probes new 0,1
  use_base; early_probes base 0; use_new
  grep -v "^==" "$out/probe_early.log" | grep -E " us |us,"
elif [ "$2" = twopage ]; then
  timeout 150 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k "register_cap" -p no:cacheprovider \
    > "$out/pytest_twopage.log" 2>&1
  tail -2 "$out/pytest_twopage.log"
  c="--geometries gpt-oss-20b --contexts 131072 --batch 8,1 --per-warp 1 --sum-pages 1 --rotate 1 --split-scale 1"
  for f in 4bit_nc k3v4_nc 3bit_nc; do
    logged_probe probe_twopage.log two_$f --formats turboquant_$f --block-n 128 --unroll 0,1 --mma-sums 1 --maxnreg 0,128 $c
  done
  logged_probe probe_twopage.log def_4bit_nc --formats turboquant_4bit_nc --block-n 256 --unroll 1 --mma-sums 1 $c
  logged_probe probe_twopage.log def_k3v4_nc --formats turboquant_k3v4_nc --block-n 256 --unroll 1 --mma-sums 0 $c
  logged_probe probe_twopage.log def_3bit_nc --formats turboquant_3bit_nc --block-n 256 --unroll 0 --mma-sums 0 $c
  grep -v "^==" "$out/probe_twopage.log" | grep -E " us \(" | sed 's/lazy=1 per_warp=1 ahead=2 sum=1 //; s/; vs Triton.*//'
elif [ "$2" = warporder ]; then
  timeout 240 python3 -m pytest -q tests/kernels/test_tq_gluon.py tests/kernels/test_tq_store.py -p no:cacheprovider \
    -k "rotating or register_cap or agrees or needle or routing or gluon_matches or planar or gpu_random" \
    > "$out/pytest_warporder.log" 2>&1
  tail -3 "$out/pytest_warporder.log"
  c="--contexts 4096,131072 --batch 8,1 --per-warp 1 --sum-pages 1 --rotate 1 --mma-sums 1 --split-scale 1"
  defaults() {  # TAG: each format's default config (tq_gluon.default_config) on both layers
    for f in 4bit_nc k3v4_nc 3bit_nc; do
      logged_probe probe_warporder.log $1_llama_$f --geometries llama-3.1-8b --formats turboquant_$f --block-n 128 --unroll 1 $c
    done
    logged_probe probe_warporder.log $1_gptoss_4bit_nc --geometries gpt-oss-20b --formats turboquant_4bit_nc --block-n 256 --unroll 1 $c
    for f in k3v4_nc 3bit_nc; do
      logged_probe probe_warporder.log $1_gptoss_$f --geometries gpt-oss-20b --formats turboquant_$f --block-n 128 --unroll 0 --maxnreg 128 $c
    done
  }
  defaults new
  logged_probe probe_warporder.log alt_gptoss_3bit_nc --geometries gpt-oss-20b --formats turboquant_3bit_nc --block-n 128 --unroll 1 --maxnreg 128 $c
  logged_probe probe_warporder.log alt4_gptoss_3bit_nc --geometries gpt-oss-20b --formats turboquant_3bit_nc --block-n 256 --unroll 0 $c
  logged_probe probe_warporder.log alt4_gptoss_k3v4_nc --geometries gpt-oss-20b --formats turboquant_k3v4_nc --block-n 256 --unroll 1 $c
  use_base_kernels
  defaults base
  use_new_kernels
  grep -v "^==" "$out/probe_warporder.log" | grep -E " us \(" | sed 's/lazy=1 per_warp=1 ahead=2 sum=1 //; s/; vs Triton.*//'
  tar -C "$out" -czf "$out/probe_warporder_json.tgz" $(cd "$out" && ls probe_*.json) && rm "$out"/probe_*.json
elif [ "$2" = keylane ]; then
  timeout 90 python3 -m pytest -q tests/kernels/test_tq_gluon.py -p no:cacheprovider -k "agrees or rotating" \
    > "$out/pytest_keylane.log" 2>&1
  tail -1 "$out/pytest_keylane.log"
  c="--geometries gpt-oss-20b --contexts 131072 --batch 8,1 --per-warp 1 --sum-pages 1 --rotate 1 --mma-sums 1 --unroll 1 --block-n 256 --split-scale 1"
  logged_probe probe_keylane.log keylane --formats turboquant_4bit_nc,turboquant_3bit_nc $c
  use_base_kernels
  logged_probe probe_keylane.log base --formats turboquant_4bit_nc,turboquant_3bit_nc $c
  use_new_kernels
  grep -E "^==| us \(" "$out/probe_keylane.log" | sed 's/lazy=1 per_warp=1 ahead=2 sum=1 //; s/; vs Triton.*//'
elif [ "$2" = offsets ]; then
  timeout 240 python3 -m pytest -q tests/kernels/test_tq_gluon.py -p no:cacheprovider \
    -k "past_8 or agrees or rotating or needle" > "$out/pytest_offsets.log" 2>&1
  tail -1 "$out/pytest_offsets.log"
  c="--contexts 131072 --per-warp 1 --sum-pages 1 --rotate 1 --mma-sums 1 --unroll 1 --split-scale 1"
  f=turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc
  for k in new base; do
    if [ $k = base ]; then use_base_kernels; fi
    logged_probe probe_offsets.log ${k}_gptoss --geometries gpt-oss-20b --batch 8,1 --block-n 256 --formats $f $c
    logged_probe probe_offsets.log ${k}_llama --geometries llama-3.1-8b --batch 8 --block-n 128 --formats $f $c
  done
  use_new_kernels
  grep -E "^==| us \(" "$out/probe_offsets.log" | sed 's/lazy=1 per_warp=1 ahead=2 sum=1 //; s/; vs Triton.*//'
  tar -C "$out" -czf "$out/probe_offsets_json.tgz" $(cd "$out" && ls probe_*.json) && rm "$out"/probe_*.json
elif [ "$2" = floor ]; then
  timeout 200 python3 bench/probe_tq_floor.py --out "$out/probe_floor_gptoss.json" > "$out/probe_floor.log" 2>&1
  timeout 100 python3 bench/probe_tq_floor.py --geometries llama-3.1-8b --formats turboquant_3bit_nc --contexts 4096,131072 \
    --out "$out/probe_floor_llama.json" >> "$out/probe_floor.log" 2>&1
  grep -v picked "$out/probe_floor.log"
  c="--geometries gpt-oss-20b --contexts 131072 --batch 8,1 --per-warp 1 --sum-pages 1 --rotate 1 --mma-sums 1 --split-scale 1,1.5"
  f=turboquant_k3v4_nc,turboquant_3bit_nc
  PROBE_LIMIT=300 logged_probe probe_twopage.log twopage --formats $f --block-n 128 --maxnreg 0,128 --unroll 0,1 $c
  logged_probe probe_twopage.log fourpage --formats $f --block-n 256 --unroll 1 $c
  grep -E "^==| us \(" "$out/probe_twopage.log" | sed 's/lazy=1 per_warp=1 ahead=2 sum=1 //; s/; vs Triton.*//'
elif [ "$2" = fused ]; then
  timeout 240 python3 -m pytest -q tests/kernels/test_tq_gluon.py -k fused -p no:cacheprovider > "$out/pytest_fused.log" 2>&1
  tail -3 "$out/pytest_fused.log"
  f3=turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc
  timeout 200 python3 bench/probe_tq_floor.py --fused --batch 1,8 --formats $f3 --out "$out/probe_fused_gptoss.json" \
    > "$out/probe_fused.log" 2>&1
  timeout 100 python3 bench/probe_tq_floor.py --fused --batch 1,8 --geometries llama-3.1-8b --contexts 4096,131072 \
    --formats turboquant_4bit_nc,turboquant_3bit_nc --out "$out/probe_fused_llama.json" >> "$out/probe_fused.log" 2>&1
  grep -v picked "$out/probe_fused.log"
elif [ "$2" = k8v4 ]; then
  PROBE_LIMIT=300 logged_probe probe_k8v4.log k8v4 --geometries gpt-oss-20b --formats turboquant_k8v4 --contexts 131072 \
    --batch 1,8 --block-n 64,128 --maxnreg 0,128 --split-scale 0.5,1,2
  grep -E "^==|: .*us, | us \(" "$out/probe_k8v4.log" | sed 's/ per_warp=0 ahead=2 sum=0 unroll=0 mma_sums=0 rotate=0//; s/; vs Triton.*//'
elif [ "$2" = unroll3 ]; then
  logged_probe probe_unroll3.log unroll3 --geometries gpt-oss-20b --formats turboquant_3bit_nc --block-n 256 --unroll 0,1 \
    --contexts 4096,131072 --batch 8,1 --per-warp 1 --sum-pages 1 --rotate 1 --mma-sums 1 --split-scale 1
  grep -E " us \(" "$out/probe_unroll3.log" | sed 's/lazy=1 per_warp=1 ahead=2 sum=1 //; s/; vs Triton.*//'
elif [ "$2" = tests ]; then
  timeout 540 python3 -m pytest -q tests/kernels/test_tq_gluon.py tests/kernels/test_tq_store.py tests/test_runtime_gpu.py \
    -p no:cacheprovider > "$out/pytest_gpu.log" 2>&1; tail -5 "$out/pytest_gpu.log"
else
  for g in llama-3.1-8b gpt-oss-20b; do
    for pw in "" --per-warp; do
      PROFILE_TAG=_$g$pw PROFILE_ARGS="--context 131072 --geometry $g $pw" timeout 100 bash bench/profile_gpu.sh "$out" ${PROFILE_FORMATS:-turboquant_4bit_nc_gl}
    done
  done
fi
