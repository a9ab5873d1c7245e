"""Checkpoints whose quantization config declares a KV-cache scheme, end to end through recommend.

vLLM loads their k/v scales into an FP8 cache (the quant config's KV-cache method), and for
ModelOpt and compressed-tensors (non-MLA) `--kv-cache-dtype auto` already stores FP8: the
decision, figures, flags and warnings must say so, never "uncalibrated" or "calibrate".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.facts.limits import startup_blockers
from kvpolicy.inputs.catalog import resolve_gpu, resolve_model
from kvpolicy.inputs.hfconfig import load_hf_config
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Recommendation
from kvpolicy.rules.validate import load_policy

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# The shape llm-compressor writes (RedHatAI FP8 checkpoints with an FP8 KV cache).
CT_FP8_KV = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": {"targets": ["Linear"],
                                           "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                       "dynamic": False, "symmetric": True}}},
             "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True}}


def rec_json(capsys, *argv: str) -> tuple[int, Recommendation]:
    code = main(["recommend", *argv, "--format", "json"])
    return code, Recommendation.model_validate_json(capsys.readouterr().out)


def no_calibration_talk(rec: Recommendation) -> None:
    text = " ".join(rec.warnings + rec.alternatives).lower()
    assert "calibrat" not in text and "uncalibrated" not in text, text


@pytest.fixture
def ct_llama(tmp_path):
    """Llama-3.1-8B's config with a compressed-tensors FP8 KV scheme (strategy set per test)."""
    def make(strategy: str = "tensor") -> Path:
        config = json.loads((FIXTURES / "llama-3.1-8b-instruct" / "config.json").read_text())
        quant = json.loads(json.dumps(CT_FP8_KV))
        quant["kv_cache_scheme"]["strategy"] = strategy
        config["quantization_config"] = quant
        folder = tmp_path / f"llama-ct-{strategy}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return folder
    return make


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_modelopt_fp8_kv_scales_are_the_checkpoints(capsys, gpu):
    # nvidia/Qwen3-30B-A3B-NVFP4: hf_quant_config.json kv_cache_quant_algo FP8.
    code, rec = rec_json(capsys, "-m", str(FIXTURES / "qwen3-30b-a3b-nvfp4"), "-g", gpu, "-c", "32k")
    assert code == 0
    assert rec.decision.kv_cache_dtype in ("auto", "fp8")
    assert rec.decision.scale_source == "checkpoint_per_tensor"
    assert rec.trace.fields["scale_source"].decided_by == "checkpoint"
    assert rec.trace.facts["model.checkpoint_kv_dtype"] == "fp8_e4m3"
    # 48 layers x 4 KV heads x 128 x 2 (K and V) x 1 byte; the BF16 baseline is twice that.
    assert rec.estimates.kv_bytes_per_token == {"full": 48 * 4 * 128 * 2}
    assert rec.estimates.kv_bytes_per_token_bf16 == {"full": 48 * 4 * 128 * 2 * 2}
    no_calibration_talk(rec)


def test_catalog_id_and_folder_agree_on_the_checkpoint_scales():
    by_id, by_folder = resolve_model("qwen3-30b-a3b-nvfp4"), load_hf_config(FIXTURES / "qwen3-30b-a3b-nvfp4")
    assert by_id.checkpoint_kv_scales == by_folder.checkpoint_kv_scales == "per_tensor"


def test_compressed_tensors_auto_means_fp8_with_the_checkpoints_scales(capsys, ct_llama):
    # 4k on H100: the policy keeps `auto`, which vLLM turns into fp8 for this checkpoint (Attention.__init__).
    code, rec = rec_json(capsys, "-m", str(ct_llama()), "-g", "h100", "-c", "4k")
    assert code == 0 and rec.decision.kv_cache_dtype == "auto"
    assert rec.vllm_args[:2] == ["--kv-cache-dtype", "auto"]
    assert rec.decision.scale_source == "checkpoint_per_tensor"
    assert rec.estimates.kv_bytes_per_token == {"full": 32 * 8 * 128 * 2}  # FP8: 1 byte per element
    assert rec.estimates.capacity_vs_bf16.value == pytest.approx(2.0, rel=0.01)
    assert any("--kv-cache-dtype auto stores fp8" in w and "--kv-cache-dtype bfloat16" in w for w in rec.warnings)
    no_calibration_talk(rec)


def test_per_head_scheme_gives_per_head_scales(capsys, ct_llama):
    code, rec = rec_json(capsys, "-m", str(ct_llama("attn_head")), "-g", "h100", "-c", "128k")
    assert code == 0 and rec.decision.kv_cache_dtype == "fp8"
    assert rec.decision.scale_source == "checkpoint_per_head" and rec.decision.attention_backend == "FLASH_ATTN"
    no_calibration_talk(rec)


def test_fp8_checkpoint_without_auto_resolution_keeps_bf16_under_auto_and_loads_scales_for_fp8(capsys):
    # tencent/Hy3-FP8: quant_method fp8 with `kv_cache_scheme: static`; Fp8Config does not resolve auto.
    arch = load_hf_config(FIXTURES / "hy3-fp8")
    assert arch.auto_kv_dtype == "auto" and arch.checkpoint_kv_scales == "per_tensor"
    code, rec = rec_json(capsys, "-m", str(FIXTURES / "hy3-fp8"), "-g", "h100", "--tp", "8", "-c", "32k")
    assert code == 0 and rec.decision.kv_cache_dtype == "fp8"
    assert rec.decision.scale_source == "checkpoint_per_tensor"
    no_calibration_talk(rec)
    code, rec = rec_json(capsys, "-m", str(FIXTURES / "hy3-fp8"), "-g", "h100", "--tp", "8", "-c", "4k")
    assert rec.decision.kv_cache_dtype == "auto" and rec.decision.scale_source == "uncalibrated"
    assert rec.estimates.kv_bytes_per_token == rec.estimates.kv_bytes_per_token_bf16


def test_mla_layers_take_no_compressed_tensors_scales(tmp_path):
    # CompressedTensorsConfig hands a KV method to `Attention` only; MLAAttention keeps scale 1.0.
    config = json.loads((FIXTURES / "deepseek-v3" / "config.json").read_text())
    config["quantization_config"] = CT_FP8_KV
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = load_hf_config(tmp_path)
    assert arch.kv_cache_scheme is not None and arch.auto_kv_dtype == "auto"
    assert arch.checkpoint_kv_scales is None


def test_fp8_e5m2_is_refused_with_fp8_checkpoints(ct_llama):
    loaded = load_policy()
    arch, gpu = load_hf_config(ct_llama()), resolve_gpu("a100")
    blockers = startup_blockers(arch, gpu, make_workload(loaded, context="32k"), "fp8_e5m2")
    assert len(blockers) == 1 and "fp8_e5m2 kv-cache is not supported with fp8 checkpoints" in blockers[0]
    plain = resolve_model("llama-3.1-8b")
    assert startup_blockers(plain, gpu, make_workload(loaded, context="32k"), "fp8_e5m2") == []


def test_calibrate_has_nothing_to_do_for_a_checkpoint_with_scales(capsys, ct_llama):
    code = main(["calibrate", "-m", str(ct_llama()), "-g", "h100", "-c", "128k"])
    out, err = capsys.readouterr()
    assert code == 0 and out == "" and "already declares FP8 KV scales" in err


def test_the_catalogs_nvfp4_entry_uses_its_checkpoint_scales():
    loaded = load_policy()
    wl = make_workload(loaded, context="32k")
    rec = recommend(resolve_model("qwen3-30b-a3b-nvfp4"), resolve_gpu("b200"), wl, loaded)
    assert rec.decision.scale_source == "checkpoint_per_tensor" and rec.blockers == []
