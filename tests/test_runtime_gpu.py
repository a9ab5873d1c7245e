"""The runtime on a CUDA GPU: the kernel path (Triton; Gluon for FP8, TurboQuant and per-token-head layers on
Hopper) agrees with the reference path, and both commands run.

Skipped where there is no GPU (tests/conftest.py); CI runs the CPU twins in the
other test_runtime_* files.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch")

from kvpolicy.cli import main
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.runtime import caches, ops
from kvpolicy.runtime.step import DecodeStep
from kvpolicy.runtime.variants import parse_variant

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")

# Tolerances of the Triton output against the float64 reference over the same cache bytes: the kernels
# multiply bf16 queries (BF16 caches: ~1e-2 relative), and FP8 runs P.V with P in e4m3 (about 3 bits of
# mantissa on each weight: a few percent); TurboQuant folds the value scale into fp16 P. One-level FP8
# accumulation keeps about 14 mantissa bits in the MMA across tiles (kernels.md: 6.6e-2 at K=4096), so its
# bound only checks the wiring. On Hopper FP8 runs the Gluon kernel, whose e4m3 query adds its own rounding
# (kernels/decode_gluon.py; the reference keeps the query in float64).
# The per-token-head formats: fp16 P x vs and, for int8/int4, the int8 query (kernels/test_per_token_head.py).
TOLERANCE = {"bf16": 2e-2, "fp8": 6e-2, "fp8+one_level": 0.3, "fp8+per_head": 6e-2, "turboquant_4bit_nc": 4e-2,
             "fp8_per_token_head": 2e-2, "int8_per_token_head": 2e-2, "int4_per_token_head": 2e-2}


def mini_oss() -> ModelArch:
    return ModelArch(id="mini-oss", num_layers=6, layer_types=["sliding", "full"] * 3, num_attention_heads=16,
                     num_kv_heads=4, head_dim=64, sliding_window=128, has_attention_sinks=True)


def mini_mla() -> ModelArch:
    return ModelArch(id="mini-mla", num_layers=2, layer_types=["mla", "mla"], num_attention_heads=16,
                     num_kv_heads=16, head_dim=192, kv_lora_rank=512, qk_rope_head_dim=64, attention="mla")


@pytest.mark.parametrize("variant", list(TOLERANCE))
def test_triton_path_matches_the_reference_on_the_same_caches(variant):
    torch.manual_seed(0)
    step = DecodeStep(mini_oss(), parse_variant(variant), batch=3, max_context=5000, device=CUDA, backend="triton")
    step.fill(5000)
    for context in (700, 5000):
        step.prepare(context)
        step.run()  # stores the new token through the Triton store kernel
        prep = step._prepared
        if variant.startswith("fp8") and torch.cuda.get_device_capability() == (9, 0) and caches.gluon_available(CUDA):
            # Hopper: the FP8 layers run the Gluon kernel (e4m3 query), one-level ones the Triton kernel's FA3 form
            # (e4m3 P.V carried in the fp8 MMA); the comparison below covers both
            assert step.layer_paths() == {"triton" if "one_level" in variant else "gluon": list(range(6))}
        if variant.endswith("per_token_head") and caches.gluon_available(CUDA):
            assert step.layer_paths() == {"gluon": list(range(6))}  # Hopper: the per-token-head Gluon kernel
        for plan in step.plans:
            cache = step.caches[plan.index]
            q = step.queries[plan.index]
            got = ops.decode(cache, plan, q, prep.block_tables[plan.index], prep.seq_lens, "triton",
                             step.variant.two_level).float()
            want = ops.decode(cache, plan, q.float(), prep.block_tables[plan.index], prep.seq_lens, "reference")
            err = float((got - want).norm() / want.norm())
            assert err < TOLERANCE[variant], f"layer {plan.index} ({plan.kind}) at {context}: {err:.2e}"


def test_mla_latent_store_on_the_gpu():
    step = DecodeStep(mini_mla(), parse_variant("fp8"), batch=2, max_context=2048, device=CUDA, backend="triton")
    step.fill(2048)
    step.prepare(2048)
    out = step.run()
    assert out.shape == (2, 16, 512) and torch.isfinite(out.float()).all()
    assert step.layer_paths() == {"reference": [0, 1]}  # 576-wide latents: the decode kernel takes <= 256


def test_bench_and_verify_on_the_gpu(tmp_path, capsys):
    folder = tmp_path / "mini-oss"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "hidden_size": 512, "sliding_window": 128, "vocab_size": 512,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 65536}))
    name = torch.cuda.get_device_name(0)
    code = main(["bench", "--model", str(folder), "--contexts", "1k..16k", "--out", str(tmp_path), "--format", "json",
                 "--record", str(tmp_path / "measured.yaml")])
    out, err = capsys.readouterr()
    if "not in kvpolicy's GPU catalog" in err:
        pytest.skip(f"{name} is not in the GPU catalog")
    assert code == 0, err
    result = json.loads(out)
    assert result["environment"]["backend"] == "triton" and result["environment"]["device"] == name
    assert "CUDA graph" in result["timing"]
    bf16 = next(f for f in result["fits"] if f["variant"] == "bf16")
    assert bf16["slope_ms_per_token"] > 0
    code = main(["verify", "--model", str(folder), "--contexts", "4k,16k", "--out", str(tmp_path),
                 "--compare", "fp8+one_level", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    verify = json.loads(out)
    assert {p["variant"] for p in verify["points"]} >= {"bf16", "fp8+one_level"}
    assert all(p["recovery"] is not None for p in verify["points"])


def test_model_level_check_on_the_gpu(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=4096)
    folder = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    code = main(["verify", "--model", str(folder), "--gpu", "h100", "--contexts", "1k,2k", "--tokens", "512",
                 "--compare", "fp8,turboquant_4bit_nc", "--out", str(tmp_path), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    checks = {c["variant"].split(" ")[0]: c for c in json.loads(out)["model_check"]}
    print({k: (c["agreement"], c["kl_mean"]) for k, c in checks.items()})
    assert {"bf16", "fp8", "turboquant_4bit_nc"} <= set(checks)
    # bf16 weights: our BF16 cache path against the model's own attention differ by bf16 rounding only.
    assert checks["bf16"]["kl_mean"] < 1e-2
    # the same figures through the float64 references beside the kernels'; the kernels add little of their own
    for name in ("fp8", "turboquant_4bit_nc"):
        c = checks[name]
        assert c["reference_kl_mean"] is not None and c["reference_agreement"] is not None
        assert c["kernel_kl_ratio"] == pytest.approx(c["kl_mean"] / c["reference_kl_mean"], rel=1e-2)
        assert c["kernel_kl_ratio"] <= 1.5, c
