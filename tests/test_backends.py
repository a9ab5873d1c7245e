"""vLLM 0.33's backends: the four users of issue 35 get vLLM's best choice, and nothing emitted is refused.

The support matrix itself is checked against vLLM's classes in test_backend_matrix.py;
here it is used the way the commands use it.
"""

from __future__ import annotations

import json

import pytest

from kvpolicy.errors import KvPolicyError
from kvpolicy.facts.backends import AttentionShape, auto_backend, problems, refusals
from kvpolicy.inputs.catalog import load_gpus, load_models, resolve_gpu, resolve_model
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.validate import load_policy
from tests.test_apply import no_vllm  # noqa: F401 - fixture
from tests.test_cli_recommend import run_cli


def _rec(model: str, gpu: str, **workload):
    loaded = load_policy()
    return recommend(resolve_model(model), resolve_gpu(gpu), make_workload(loaded, **workload), loaded)


def _vllm_pick(rec) -> str | None:
    arch, gpu = resolve_model(rec.model), resolve_gpu(rec.gpu)
    return auto_backend(rec.decision.kv_cache_dtype, gpu.sm, AttentionShape.of(arch, rec.workload.tp))


# -- the four users ------------------------------------------------------------------------

def test_memory_bound_blackwell_user_gets_nvfp4_on_flashinfer():
    rec = _rec("llama-3.1-8b", "b200", context="128k", concurrency=25)
    assert rec.decision.kv_cache_dtype == "nvfp4" and rec.decision.attention_backend == "FLASHINFER"
    assert rec.decision.attention_backend == _vllm_pick(rec)
    assert rec.unsupported == []
    assert {"nvfp4-kv-nvidia", "nvfp4-kv-vllm-backends"} <= {e.id for e in rec.evidence}
    # It holds what FP8 cannot: the reason it was chosen.
    assert rec.trace.facts["memory.max_concurrency_fp8"] < 25 <= rec.estimates.max_concurrency.value


def test_hopper_user_without_calibrated_scales_gets_per_token_head_on_triton():
    rec = _rec("llama-3.1-8b", "h100", context="32k", accuracy_floor=0.98)
    d = rec.decision
    assert (d.kv_cache_dtype, d.scale_source, d.attention_backend) == \
        ("fp8_per_token_head", "per_token_head", "TRITON_ATTN")
    assert d.attention_backend == _vllm_pick(rec) and rec.unsupported == []
    assert "per-token-head-pr-39074" in {e.id for e in rec.evidence}
    assert any("GSM8K 0.966" in w for w in rec.warnings)
    # At the studies' floor uncalibrated FP8 is fine and keeps FA3.
    plain = _rec("llama-3.1-8b", "h100", context="32k")
    assert plain.decision.kv_cache_dtype == "fp8" and plain.decision.attention_backend == "FLASH_ATTN"


@pytest.mark.parametrize(("model", "gpu", "backend"), [
    ("deepseek-v3", "b200", "FLASHINFER_MLA"),
    ("kimi-k2.5", "b200", "FLASHINFER_MLA"),
    ("deepseek-v3", "h200", "FLASHMLA"),
])
def test_mla_user_gets_the_backend_vllm_picks(model, gpu, backend):
    rec = _rec(model, gpu, context="32k", tp=8)
    assert rec.decision.kv_cache_dtype == "fp8" and rec.decision.attention_backend == backend
    assert backend == _vllm_pick(rec)
    assert not [g for g in rec.unsupported if "attention-backend" in g or "no vLLM" in g]


def test_sparse_mla_user_gets_ds_mla_on_flashmla_sparse_on_hopper_and_flashinfer_on_blackwell():
    hopper = _rec("deepseek-v3.2-exp", "h200", context="64k", tp=8)
    assert (hopper.decision.kv_cache_dtype, hopper.decision.attention_backend) == ("fp8_ds_mla", "FLASHMLA_SPARSE")
    assert hopper.decision.attention_backend == _vllm_pick(hopper) and hopper.unsupported == []
    assert "sparse-mla-fp8-ds-mla" in {e.id for e in hopper.evidence}
    # The capacity is fp8_ds_mla's 656 bytes per token (plus the indexer's), not plain fp8's 576.
    assert hopper.estimates.kv_bytes_per_token["mla"] == 656 * 61
    blackwell = _rec("deepseek-v3.2-exp", "b200", context="32k", tp=8)
    assert (blackwell.decision.kv_cache_dtype, blackwell.decision.attention_backend) == \
        ("fp8", "FLASHINFER_MLA_SPARSE")
    assert blackwell.decision.attention_backend == _vllm_pick(blackwell)


# -- the three combinations vLLM refuses ----------------------------------------------------

def test_dense_flashmla_on_blackwell_is_refused_and_never_emitted():
    shape = AttentionShape.of(resolve_model("deepseek-v3"), 8)
    assert "FlashMLA Dense is only supported on Hopper devices" in " ".join(refusals("FLASHMLA", "fp8", 100, shape))
    rec = _rec("deepseek-v3", "b200", tp=8)
    assert "FLASHMLA" not in rec.vllm_args


def test_flashmla_for_a_sparse_mla_model_is_refused_and_never_emitted():
    for model in ("deepseek-v3.2-exp", "glm-5"):
        shape = AttentionShape.of(resolve_model(model), 8)
        assert shape.kind == "sparse_mla"
        why = problems("fp8", "FLASHMLA", 90, shape)
        assert why and "serves dense MLA only" in why[0] and "use FLASHMLA_SPARSE" in why[0]
        for gpu in ("h200", "b200"):
            assert _rec(model, gpu, tp=8).decision.attention_backend != "FLASHMLA"


def test_flash_attn_for_gemma_4_head_dim_512():
    shape = AttentionShape.of(resolve_model("gemma-4-31b-it"))
    assert shape.head_sizes == (256, 512)
    # Refused where FlashAttention 4 does not run (Ampere) and on Blackwell, where FA4 stops at 256.
    assert any("head sizes above 256" in r for r in refusals("FLASH_ATTN", "auto", 80, shape))
    assert any("FA4 on Blackwell" in r for r in refusals("FLASH_ATTN", "auto", 100, shape))
    for gpu in ("a100", "b200"):
        assert _rec("gemma-4-31b-it", gpu).decision.attention_backend != "FLASH_ATTN"
    # On Hopper vLLM 0.33 serves head 512 with FA4 (Gemma4Config picks it), FP8 included.
    assert refusals("FLASH_ATTN", "fp8", 90, shape) == []


def test_per_head_pin_on_mla_is_refused_alike_by_check_and_apply(tmp_path, capsys, no_vllm):  # noqa: F811
    policy = tmp_path / "kvpolicy.yaml"
    policy.write_text("version: 1\nextends: builtin:default\npins:\n  - name: per-head\n"
                      "    when: {fact: model.id, op: eq, value: kimi-k2.5}\n"
                      "    set: {scale_source: checkpoint_per_head}\n    reason: test\n"
                      "deployments:\n  - {name: agent, model: kimi-k2.5, gpu: h200, context: 32k, tp: 8}\n"
                      "  - {name: chat, model: llama-3.1-8b, gpu: h100, context: 32k}\n")
    code, out, _ = run_cli(capsys, "check", str(policy), "--strict")
    assert code == 1 and "no vLLM 0.33.0 backend" in out
    code, _, err = run_cli(capsys, "apply", "-p", str(policy), "-d", "agent", "--dry-run", "--strict")
    assert code == 1 and "no vLLM 0.33.0 backend" in err
    code, _, err = run_cli(capsys, "apply", "-p", str(policy), "-d", "chat", "--dry-run", "--strict")
    assert code == 0
    code, out, _ = run_cli(capsys, "lint", str(policy))
    assert code == 1 and "KVL303" in out


def test_check_strict_and_apply_strict_refuse_the_same(capsys, no_vllm):  # noqa: F811
    """Every deployment of the team example: check --strict fails it exactly when apply --strict refuses it."""
    from tests.test_cli_policy import TEAM

    for dep in ("chat-llama-8b", "rag-gpt-oss", "agent-kimi", "batch-summarize", "search-qwen-b200"):
        check_code, check_out, _ = run_cli(capsys, "check", str(TEAM), "-d", dep, "--strict", "--format", "json")
        apply_code, _, apply_err = run_cli(capsys, "apply", "-p", str(TEAM), "-d", dep, "--dry-run", "--strict")
        warned = [w for w in json.loads(check_out)["results"][0]["report"]["warnings"]
                  if w.startswith("stock vLLM cannot carry out")]
        assert bool(warned) == (apply_code == 1), (dep, warned, apply_err)


# -- nothing emitted is refused ---------------------------------------------------------------

def test_no_emitted_backend_or_dtype_is_one_vllm_refuses():
    loaded = load_policy()
    gpus = [g for g in load_gpus().values() if g.vendor == "nvidia"]
    checked = 0
    for model_id in load_models():
        arch = resolve_model(model_id)
        for gpu in gpus:
            for ctx, conc in (("8k", 1), ("128k", 4)):
                try:
                    wl = make_workload(loaded, context=ctx, concurrency=conc, tp=8 if arch.num_layers > 40 else 1)
                    rec = recommend(arch, gpu, wl, loaded)
                except KvPolicyError:
                    continue
                shape = AttentionShape.of(arch, wl.tp)
                if auto_backend("auto", gpu.sm, shape) is None:
                    continue  # vLLM runs this model on no backend of this GPU at all
                d = rec.decision
                assert not problems(d.kv_cache_dtype, d.attention_backend, gpu.sm, shape), (model_id, gpu.id, ctx, d)
                checked += 1
    assert checked > 200
