"""The cases issue 2 says must come out right, through the public `recommend()` flow."""

from __future__ import annotations

import itertools
import math

import pytest

from kvpolicy.facts.kv_memory import layer_kv_bytes_per_token
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.catalog import load_gpus, load_models, resolve_gpu, resolve_model
from kvpolicy.inputs.workload import make_workload, parse_tokens
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Recommendation
from kvpolicy.rules.validate import load_policy


@pytest.fixture(scope="module")
def builtin():
    return load_policy()


def rec(builtin, model: str, gpu: str, **workload) -> Recommendation:
    return recommend(resolve_model(model), resolve_gpu(gpu), make_workload(builtin, **workload), builtin)


def decided_by(r: Recommendation, field: str) -> str:
    return r.trace.fields[field].decided_by


def test_gpt_oss_20b_h100_long_decode(builtin):
    r = rec(builtin, "gpt-oss-20b", "h100", context="32k", priority="decode")
    d = r.decision
    assert d.kv_cache_dtype == "fp8"
    assert d.skip_layers == ["sliding_window"]
    assert d.two_level_accumulation == "on"
    assert d.scale_source == "uncalibrated"
    assert d.attention_backend == "FLASH_ATTN"
    assert r.estimates.itl_slope_ratio.value == pytest.approx(0.71, abs=0.01)
    assert r.estimates.itl_slope_ratio.provenance == "measured"
    assert r.estimates.break_even_tokens.value == pytest.approx(7659)
    assert r.vllm_args[:4] == ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window"]
    assert decided_by(r, "skip_layers") == "KV201"
    # The sliding layers stay BF16 (12 layers x 8 heads x 128 x 2 bytes), full layers drop to FP8.
    assert r.estimates.kv_bytes_per_token == {"sliding": 24576, "full": 12288}


def test_llama_8b_h100_long_context_fp8_short_context_bf16(builtin):
    long = rec(builtin, "Llama-3.1-8B", "h100", context="32k")
    assert long.decision.kv_cache_dtype == "fp8"
    assert long.decision.skip_layers == []
    assert long.estimates.itl_slope_ratio.value == pytest.approx(0.54, abs=0.01)
    short = rec(builtin, "llama-3.1-8b", "h100", context="4k")
    assert short.decision.kv_cache_dtype == "auto"
    assert decided_by(short, "kv_cache_dtype") == "KV106"
    assert short.decision.two_level_accumulation == "not_applicable"
    assert short.trace.facts["latency.fp8_best_break_even_tokens"] == pytest.approx(7010)


def test_llama_8b_b200_6k(builtin):
    r = rec(builtin, "meta-llama/Llama-3.1-8B-Instruct", "b200", context="6k")
    assert r.decision.kv_cache_dtype == "fp8"
    assert r.estimates.break_even_tokens.value == pytest.approx(4000, rel=0.1)
    assert r.decision.two_level_accumulation == "not_applicable"
    assert r.decision.attention_backend == "FLASHINFER"
    # The same 6k context on Hopper is below the ~7k break-even.
    assert rec(builtin, "llama-3.1-8b", "h100", context="6k").decision.kv_cache_dtype == "auto"


def test_gemma_4_e2b_prefill_keeps_bf16_decode_quantizes_sliding(builtin):
    prefill = rec(builtin, "gemma-4-E2B", "h100", context="64k", priority="prefill")
    assert prefill.decision.kv_cache_dtype == "auto"
    assert decided_by(prefill, "kv_cache_dtype") == "KV105"
    assert any("FLASH_ATTENTION_DISABLE_FP8_TWO_LEVEL_ACCUMULATION" in w for w in prefill.warnings)
    decode = rec(builtin, "gemma-4-E2B", "h100", context="64k", priority="decode")
    assert decode.decision.kv_cache_dtype == "fp8"
    assert decode.decision.skip_layers == []
    assert decided_by(decode, "skip_layers") == "KV202"
    assert "sliding" in decode.estimates.kv_bytes_per_token
    assert decode.estimates.kv_bytes_per_token["sliding"] * 2 == decode.estimates.kv_bytes_per_token_bf16["sliding"]


def test_kimi_k25_h200_calibrated_fp8_on_flashmla(builtin):
    r = rec(builtin, "kimi-k2.5", "h200", context="32k", tp=8)
    assert r.decision.kv_cache_dtype == "fp8"
    assert r.decision.attention_backend == "FLASHMLA"
    assert r.decision.scale_source in ("checkpoint_per_tensor", "checkpoint_per_head")
    assert any("calibrat" in w for w in r.warnings)
    # MLA: one latent per token per layer, not split across ranks: 61 x 576 bytes in FP8.
    assert r.estimates.kv_bytes_per_token == {"mla": 61 * 576}


def test_memory_bound_llama_70b_offers_turboquant(builtin):
    # 4 x H100 at 128k: BF16 holds ~3 requests, FP8 ~7, turboquant_4bit_nc ~12.
    kw = dict(context="128k", concurrency=10, tp=4)
    r = rec(builtin, "llama-3.3-70b", "h100", **kw)
    assert r.trace.facts["memory.fits_fp8"] is False
    assert r.trace.facts["memory.fits_turboquant_4bit_nc"] is True
    # At the default 0.95 floor 4bit_nc (MRCR 92% of BF16) is offered with its costs, not chosen.
    assert r.decision.kv_cache_dtype == "fp8"
    offer = " ".join(r.alternatives)
    assert "turboquant_4bit_nc" in offer and "throughput" in offer and "latency" in offer
    chosen = rec(builtin, "llama-3.3-70b", "h100", accuracy_floor=0.9, **kw)
    assert chosen.decision.kv_cache_dtype == "turboquant_4bit_nc"
    assert chosen.decision.attention_backend == "TURBOQUANT"
    assert chosen.estimates.capacity_vs_bf16.value == pytest.approx(3.35, abs=0.05)
    assert any("75% of BF16 throughput" in w for w in chosen.warnings)


def test_builtin_policy_never_chooses_k8v4_or_3bit(builtin):
    models = ["llama-3.1-8b", "llama-3.3-70b", "qwen3-32b", "gpt-oss-20b", "mistral-7b-v0.3"]
    seen = set()
    for model, gpu, ctx, conc, floor in itertools.product(
        models, ["h100", "a100", "b200", "l40s"], ["4k", "32k", "128k"], [1, 16, 256], [0.5, 0.95]
    ):
        if parse_tokens(ctx) > load_models()[model].max_model_len:
            continue  # vLLM refuses it (test_limits.py)
        r = rec(builtin, model, gpu, context=ctx, concurrency=conc, accuracy_floor=floor)
        seen.add(r.decision.kv_cache_dtype)
    assert not seen & {"turboquant_k8v4", "turboquant_k3v4_nc", "turboquant_3bit_nc"}
    assert "turboquant_4bit_nc" in seen  # the sweep does reach the memory-bound case


def test_a100_bf16_or_e5m2_storage(builtin):
    r = rec(builtin, "llama-3.1-8b", "a100", context="32k")
    assert r.decision.kv_cache_dtype == "auto"
    assert decided_by(r, "kv_cache_dtype") == "KV101"
    assert r.decision.two_level_accumulation == "not_applicable"
    bound = rec(builtin, "llama-3.1-8b", "a100", context="128k", concurrency=16)
    assert bound.decision.kv_cache_dtype == "fp8_e5m2"
    assert bound.decision.attention_backend == "TRITON_ATTN"
    assert any("no FP8 tensor cores" in w for w in bound.warnings)


def test_capacity_matches_vllm_formula():
    llama = load_models()["llama-3.1-8b"]
    bf16 = sum(layer_kv_bytes_per_token(llama, i, FORMATS["auto"]) for i in range(llama.num_layers))
    assert bf16 == 131072
    fp8 = sum(layer_kv_bytes_per_token(llama, i, FORMATS["fp8"]) for i in range(llama.num_layers))
    assert fp8 == 65536
    # Tensor parallelism splits the KV heads: 8 heads over tp=2 -> half per rank.
    assert sum(layer_kv_bytes_per_token(llama, i, FORMATS["auto"], tp=2) for i in range(32)) == 65536


def test_capacity_estimate_is_vllms_logged_kv_cache_size(builtin):
    r = rec(builtin, "llama-3.1-8b", "h100", context="32k")
    e = r.estimates
    assert e.kv_capacity_tokens.value == pytest.approx(2 * e.kv_capacity_tokens_bf16.value, rel=1e-3)
    assert e.capacity_vs_bf16.value == pytest.approx(2.0)
    gpu = load_gpus()["h100-sxm"]
    # Modelled budget: ceil(memory x 0.92) - weights (the checkpoint's total_size) - 2.5 GiB reserve.
    budget = math.ceil(gpu.memory_gib * (1 << 30) * 0.92) - 16_060_522_496 - int(2.5 * (1 << 30))
    # One full-attention group: 32 layers x 16 tokens x 4096 B = 2 MiB per block; 2048 blocks per 32k request.
    num_blocks = budget // (32 * 16 * 4096)
    assert e.kv_capacity_tokens_bf16.value == int(num_blocks / 2048 * 32768)
    fp8_blocks = budget // (32 * 16 * 2048)  # the decided dtype is fp8: 1 MiB blocks
    assert r.decision.kv_cache_dtype == "fp8" and e.max_concurrency.value == round(fp8_blocks / 2048, 2)
    assert e.kv_bytes_per_request.value == 32768 * 131072 // 2


@pytest.mark.parametrize("text,tokens", [("32k", 32768), ("131072", 131072), ("128K", 131072),
                                         ("1.5k", 1536), ("1m", 1048576), (" 4k ", 4096)])
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("bad", ["-5", "0", "32q", "k", "", "3.2.1k"])
def test_parse_tokens_rejects(bad):
    from kvpolicy.errors import InputError

    with pytest.raises(InputError, match="--context"):
        parse_tokens(bad)


def test_same_inputs_same_decision(builtin):
    a = rec(builtin, "gpt-oss-20b", "h100", context="32k")
    b = rec(builtin, "gpt-oss-20b", "h100", context="32k")
    assert a.model_dump() == b.model_dump()


@pytest.mark.parametrize("model", ["gpt-oss-20b", "llama-3.1-70b"])
def test_answers_do_not_depend_on_earlier_calls(model):
    """recommend() reuses a deployment's figures across priorities and concurrencies of one model, GPU and
    context: each answer equals the one a fresh policy object (nothing reused) gives."""
    arch, gpu = resolve_model(model), resolve_gpu("h100")
    shared = load_policy()
    for priority, concurrency in [("decode", 1), ("prefill", 64), ("balanced", 4096), ("decode", 2)]:
        wl = make_workload(shared, context="128k", priority=priority, concurrency=concurrency)
        fresh = load_policy()
        alone = recommend(arch, gpu, make_workload(fresh, context="128k", priority=priority,
                                                   concurrency=concurrency), fresh)
        assert recommend(arch, gpu, wl, shared).model_dump() == alone.model_dump()


def test_trace_lists_every_rule_with_reason(builtin):
    r = rec(builtin, "gpt-oss-20b", "h100")
    ids = [o.id for o in r.trace.rules]
    assert ids == [x.id for x in builtin.policy.rules if x.enabled]
    assert all(o.reason for o in r.trace.rules)
    assert set(r.trace.fields) == {"kv_cache_dtype", "skip_layers", "two_level_accumulation",
                                   "scale_source", "attention_backend"}
    assert {e.id for e in r.evidence} >= {"fp8-itl-gpt-oss-20b-h100", "fp8-two-level-needle-128k"}


def test_measured_line_that_never_crosses_bf16_keeps_bf16(tmp_path):
    """A user's own bench record where FP8 never decodes faster overrides the studies' threshold."""
    policy = tmp_path / "measured.yaml"
    policy.write_text(
        "extends: builtin:default\n"
        "evidence:\n"
        "  - id: my-h200-llama\n"
        "    statement: our H200, FP8 slope above BF16's\n"
        "    source: kvpolicy bench --record\n"
        "    itl:\n"
        "      model: llama-3.1-8b\n"
        "      gpu: h200\n"
        "      variants:\n"
        "        bf16: {slope_ms_per_token: 2.9e-05, intercept_ms: 0.41}\n"
        "        fp8: {slope_ms_per_token: 3.0e-05, intercept_ms: 0.40}\n"
    )
    loaded = load_policy(policy)
    r = rec(loaded, "llama-3.1-8b", "h200", context="128k")
    assert r.decision.kv_cache_dtype == "auto"
    assert decided_by(r, "kv_cache_dtype") == "KV106"
    assert r.trace.facts["latency.fp8_never_faster"] is True
    # Without the record, the studies' threshold applies and 128k is FP8.
    assert rec(load_policy(), "llama-3.1-8b", "h200", context="128k").decision.kv_cache_dtype == "fp8"


def test_capacity_messages_say_1_request_not_1_requests(builtin):
    short = rec(builtin, "llama-3.1-70b", "h100", context="32k", concurrency=8, tp=2)
    assert "BF16 holds 1 request of 32,768 tokens, FP8 2; 8 requested." in short.warnings
    assert any(a.startswith("Even FP8 holds only 2 requests of 32,768 tokens") for a in short.alternatives)
    shorter = rec(builtin, "llama-3.1-70b", "h100", context="64k", concurrency=8, tp=2)
    assert any(a.startswith("Even FP8 holds only 1 request of 65,536 tokens") for a in shorter.alternatives)


def test_a_policy_template_names_a_count_with_its_noun(tmp_path):
    from kvpolicy.policy.lint import lint_path

    path = tmp_path / "kvpolicy.yaml"
    path.write_text(
        "version: 1\nname: team\nextends: builtin:default\nrules:\n"
        "  - id: TEAM101\n    name: say-capacity\n    statement: s\n    evidence: [fp8-capacity]\n"
        "    when: {fact: model.id, op: eq, value: llama-3.1-70b}\n"
        "    advise: ['FP8: {memory.max_concurrency_fp8|query|queries}, BF16: {memory.max_concurrency_bf16|request}, "
        "{workload.tp|GPU}, context {workload.context_tokens}.']\n")
    assert [f for f in lint_path(path) if f.severity != "info"] == []
    team = load_policy(str(path))
    r = rec(team, "llama-3.1-70b", "h100", context="32k", concurrency=8, tp=2)
    assert "FP8: 2 queries, BF16: 1 request, 2 GPUs, context 32,768." in r.alternatives
    r = rec(team, "llama-3.1-70b", "h100", context="64k", concurrency=8, tp=1)
    assert any(a.startswith("FP8: 0 queries, BF16: 0 requests, 1 GPU,") for a in r.alternatives)
