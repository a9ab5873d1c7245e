#!/usr/bin/env bash
# GPU runs on the device machine (one H200), from the repository root: bash bench/device.sh OUTDIR MODE
#   tests     the GPU-marked kernel tests (and the runtime's where kvpolicy's dependencies are there);
#             TESTS_K: a -k expression
#   bench     the kernel benchmark, every row and cuDNN/flash in the same run (BENCH_ARGS: bench_decode options)
#   ab        the kernel benchmark of the tree in .ab/old (git-ignored; carry it) and of this one in the same
#             call, GPU tests first (-x, AB_TESTS), then the table of every row's slope old vs new
#             (AB_ROWS, AB_CONTEXTS: the rows and contexts; slopes over AB_CONTEXTS)
#   runtime   kvpolicy bench --record and verify for both layers, then tests/test_runtime_gpu.py (needs .whl)
#   pth       the per-token-head kernels (Triton and Gluon): their GPU tests and the runtime's (TESTS_K), then batch
#             8 at 32k-128k on both layers against cuDNN BF16 and our FP8 kernels (PTH_ROWS, PTH_CONTEXTS, PTH_BATCH,
#             PTH_TIMEOUT)
#   runtime37 issue 37's targets before (the tree in .ab/rt_base, carried) and after (this tree), same call: GPU
#             tests, kvpolicy bench (Llama, fp8 and turboquant_4bit_nc, batch 1), bench_host.py's host cost, the
#             BF16 kernel against cuDNN eager and in graph replay, the one-level needle verify at 64k-256k
#   model     verify's model-level check on a real checkpoint through the kernels and the float64 references,
#             with the retrieval test (MODEL_ARGS: verify options). A checkpoint above the 64 MiB a call carries
#             travels in parts (split -b; carried as .ab/part*/ over calls while the machine is warm): each
#             call keeps its parts in /tmp/parts and the run starts once their concatenation has MODEL_MD5
#   evidence  the evidence run (every row, batch 8, --evidence) and the Gluon rows at batch 1 (KVP_COMMIT: the
#             commit measured)
# Logs and JSON go to OUTDIR (the device returns at most 8 files). Pure-Python wheels that the device image lacks
# (pydantic, ruamel.yaml; `pip download` them into the git-ignored .whl/ and carry it) are installed when present.
set -uo pipefail
out=${1:?usage: bash bench/device.sh OUTDIR tests|bench|ab|runtime|runtime37|pth|model|evidence}
mode=${2:?usage: bash bench/device.sh OUTDIR tests|bench|ab|runtime|runtime37|pth|model|evidence}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
pytest_gpu() {  # LOG ARGS...: GPU-marked tests, quiet, into OUTDIR/LOG; prints the summary
  local log=$1; shift
  python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$out/$log" 2>&1
  local rc=$?
  tail -3 "$out/$log"
  return $rc
}
gl=turboquant_k8v4_gl,turboquant_4bit_nc_gl,turboquant_k3v4_nc_gl,turboquant_3bit_nc_gl
case $mode in
tests)
  targets=(tests/kernels)
  python3 -c "import pydantic, ruamel.yaml" 2> /dev/null && targets+=(tests/test_runtime_gpu.py)
  pytest_gpu pytest.log "${targets[@]}" ${TESTS_K:+-k "$TESTS_K"}
  ;;
bench)
  timeout 540 python3 bench/bench_decode.py ${BENCH_ARGS:-} --out "$out/bench_decode.json" > "$out/bench_decode.log" 2>&1
  sed -n '/^## /,$p' "$out/bench_decode.log"
  ;;
ab)
  old=.ab/old
  [ -d "$old" ] || { echo "no $old: copy the tree to compare into it first"; exit 2; }
  # a tree from before kvpolicy/kernels/ (kernels/ installed as kvpolicy.kernels) runs through a link
  [ -d "$old/kernels" ] && [ ! -e "$old/kvpolicy/kernels" ] && ln -s ../kernels "$old/kvpolicy/kernels"
  rows=${AB_ROWS:-bf16,fp8,fp8_gl,$gl,sdpa_cudnn}
  ctx=${AB_CONTEXTS:-32768,65536,131072}
  k=${AB_TESTS:-"realistic_shapes or agrees_with_triton or store_then_decode or fused_merge_replays or (matches_reference and (None-True-3-128-32 or None-True-3-64-64))"}
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels -k "$k" > "$out/pytest.log" 2>&1
  echo "tests: $(tail -1 "$out/pytest.log")"
  args=(--formats "$rows" --contexts "$ctx" --batch 1,8 --skip-accuracy)
  (cd "$old" && PYTHONPATH="$PWD" timeout 200 python3 bench/bench_decode.py "${args[@]}" --out "$out/ab_old.json") \
    > "$out/ab_old.log" 2>&1 || echo "old tree's run failed: $(tail -2 "$out/ab_old.log")"
  timeout 200 python3 bench/bench_decode.py "${args[@]}" --out "$out/ab_new.json" > "$out/ab_new.log" 2>&1 \
    || echo "this tree's run failed: $(tail -2 "$out/ab_new.log")"
  python3 bench/bench_decode.py --compare "$out/ab_old.json" "$out/ab_new.json" | tee "$out/ab_table.md"
  ;;
runtime)
  kvp() { python3 -m kvpolicy "$@"; }
  kvp bench -m llama-3.1-8b --contexts 1k..128k --batch 1 --compare turboquant_4bit_nc \
      --record "$out/measured-h200.yaml" --out "$out"
  kvp bench -m gpt-oss-20b --contexts 1k..128k --batch 1 --record "$out/measured-h200.yaml" --out "$out"
  kvp verify -m llama-3.1-8b --contexts 4k..128k --compare fp8+one_level,turboquant_4bit_nc,turboquant_3bit_nc \
      --out "$out"
  kvp verify -m gpt-oss-20b --contexts 4k..128k --compare fp8+one_level --out "$out"
  for c in 4k 32k; do kvp recommend -m llama-3.1-8b -g auto -c $c --policy "$out/measured-h200.yaml" -f json |
      python3 -c "import json,sys; r=json.load(sys.stdin); e=r['estimates']; print('$c', r['decision']['kv_cache_dtype'], e['itl_slope_ratio'], e['break_even_tokens'])"; done
  pytest_gpu pytest_runtime.log -rs tests/test_runtime_gpu.py
  ;;
pth)
  targets=(tests/kernels/test_per_token_head.py tests/kernels/test_pth_gluon.py)
  python3 -c "import pydantic, ruamel.yaml" 2> /dev/null && targets+=(tests/test_runtime_gpu.py)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "${targets[@]}" ${TESTS_K:+-k "$TESTS_K"} \
      > "$out/pytest.log" 2>&1
  echo "tests: $(tail -1 "$out/pytest.log")"
  pth=fp8_per_token_head,int8_per_token_head,int4_per_token_head
  rows=${PTH_ROWS:-fp8_gl,fp8,$pth,${pth//_head/_head_gl},${pth//_head/_head_gl_n128s2},fp8_per_token_head_gl_q8,sdpa_cudnn}
  timeout ${PTH_TIMEOUT:-300} python3 bench/bench_decode.py --formats "$rows" --contexts ${PTH_CONTEXTS:-32768,65536,131072} \
      --batch ${PTH_BATCH:-8} --skip-accuracy --out "$out/bench_pth.json" > "$out/bench_pth.log" 2>&1
  sed -n '/^## /,$p' "$out/bench_pth.log"
  ;;
runtime37)
  # the device returns 8 files: the 7 JSON below and summary.log; logs go to /tmp
  base=${AB_BASE:-.ab/rt_base}; tmp=/tmp/r37; mkdir -p $tmp
  fits() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(f\"{f['variant']:22} slope {f['slope_ms_per_token']:.4e} intercept {f['intercept_ms']:.4f} ratio {f['slope_ratio']} be {f['break_even_tokens']}\") for f in r['fits']]" "$1"; }
  verdicts() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(p['variant'], p['context_tokens'], p['hits'], p['trials'], p['recovery'], p['out_rel_error']) for p in r['points']]" "$1"; }
  {
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_decode_attention.py tests/kernels/test_tq_store.py \
      tests/test_runtime_gpu.py -k "${R37_TESTS:-two_level or chained or realistic or runtime or store}" -s > $tmp/pytest.log 2>&1
  echo "tests: $(grep -E "errors|passed|failed" $tmp/pytest.log | tail -3)"
  cp bench/bench_host.py "$base/bench/" 2>/dev/null
  for tree in base this; do
    dir=.; [ $tree = base ] && dir=$base
    (cd "$dir" && PYTHONPATH="$PWD:/tmp/site" timeout 120 python3 -m kvpolicy bench -m llama-3.1-8b --compare fp8,turboquant_4bit_nc \
        --batch 1 --contexts 1k..128k --no-plot -f json --out $tmp/b_$tree > "$out/bench_$tree.json" 2> $tmp/bench_$tree.err)
    echo "== kvpolicy bench ($tree)"; fits "$out/bench_$tree.json" || tail -3 $tmp/bench_$tree.err
    (cd "$dir" && PYTHONPATH="$PWD:/tmp/site" timeout 90 python3 bench/bench_host.py --sections "${R37_HOST:-host}" \
        --json "$out/host_$tree.json" > $tmp/host_$tree.log 2>&1) || echo "host $tree failed: $(tail -2 $tmp/host_$tree.log)"
    grep "^|" $tmp/host_$tree.log | grep -v -- "---"
    (cd "$dir" && PYTHONPATH="$PWD:/tmp/site" timeout 100 python3 -m kvpolicy verify -m llama-3.1-8b \
        --contexts 64k,128k,256k --compare fp8+one_level -f json --out $tmp/v_$tree > "$out/verify_$tree.json" \
        2> $tmp/verify_$tree.err) || echo "verify $tree failed: $(tail -2 $tmp/verify_$tree.err)"
    echo "== verify ($tree)"; verdicts "$out/verify_$tree.json"
  done
  timeout 120 python3 bench/bench_host.py --sections graph --json "$out/graph.json" > $tmp/graph.log 2>&1
  grep "^|" $tmp/graph.log | grep -v -- "---"
  } 2>&1 | tee "$out/summary.log"
  ;;
model)
  mkdir -p /tmp/parts && cp .ab/part*/* /tmp/parts/ 2> /dev/null
  cat /tmp/parts/* > /tmp/model.gguf
  have=$(md5sum < /tmp/model.gguf | cut -d' ' -f1)
  [ "$have" = "${MODEL_MD5:?set MODEL_MD5}" ] || { echo "parts so far: $(ls /tmp/parts | tr '\n' ' ')"; exit 0; }
  timeout 540 python3 -m kvpolicy verify -m /tmp/model.gguf -f json --out "$out" ${MODEL_ARGS:-} \
      > "$out/verify_model.json" 2> "$out/verify_model.err"
  echo "verify: exit $?"; tail -5 "$out/verify_model.err"
  python3 - "$out/verify_model.json" << 'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for c in r["model_check"]:
    print(f"{c['variant'][:40]:40} agree {c['agreement']:.4f} kl {c['kl_mean']:.4g} p99 {c['kl_p99']} ppl {c['ppl_delta']} "
          f"| ref agree {c['reference_agreement']} kl {c['reference_kl_mean']} ratio {c['kernel_kl_ratio']}")
for p in r["retrieval"]:
    print("retrieval", p["variant"], p["context_tokens"], p["hits"], p["trials"], p["recovery"], p["kept"], p["bf16_hits"])
for p in r["points"]:
    print("needle", p["geometry"][:20], p["variant"], p["context_tokens"], p["hits"], p["trials"], p["recovery"])
for v in r["verdicts"]:
    print("verdict", v["variant"], v["verdict"], v["basis"], v["reason"][:160])
print("warnings", r["warnings"])
PY
  ;;
evidence)
  export KVP_COMMIT=${KVP_COMMIT:-unknown}
  timeout 360 python3 bench/bench_decode.py \
      --formats bf16,fp8,fp8_gl,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,$gl,sdpa_cudnn \
      --contexts 4096,16384,65536,131072 --batch 8 --skip-accuracy --evidence "$out/evidence.yaml" \
      --out "$out/evidence_b8.json" > "$out/evidence_b8.log" 2>&1
  timeout 120 python3 bench/bench_decode.py --formats sdpa_cudnn,fp8_gl,$gl --contexts 4096,16384,65536,131072 \
      --batch 1 --skip-accuracy --out "$out/evidence_b1.json" > "$out/evidence_b1.log" 2>&1
  grep -h -A14 "slope ns/token" "$out/evidence_b8.log" "$out/evidence_b1.log"
  ;;
*)
  echo "unknown mode $mode: tests, bench, ab, runtime, runtime37, pth, model or evidence"; exit 2
  ;;
esac
