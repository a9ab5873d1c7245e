"""Model and GPU catalogs: every entry validates, names resolve, unknown names help."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpolicy.errors import InputError
from kvpolicy.facts.kv_memory import layer_kv_bytes_per_token
from kvpolicy.formats import FORMATS
from kvpolicy.inputs import catalog
from kvpolicy.inputs.catalog import (
    gpu_and_count,
    load_gpus,
    load_models,
    resolve_gpu,
    resolve_gpu_count,
    resolve_model,
)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def bf16_kv_bytes(model_id: str) -> int:
    arch = resolve_model(model_id)
    return sum(layer_kv_bytes_per_token(arch, i, FORMATS["auto"]) for i in range(arch.num_layers))


# -- the data -------------------------------------------------------------------------------


def test_every_model_entry_validates_and_is_well_formed():
    models = load_models()
    assert len(models) >= 25
    for key, arch in models.items():
        assert key == arch.id == key.lower()
        assert arch.family and arch.source and arch.hf_id
        assert arch.weight_bytes > 0 and arch.weights_basis, key
        assert arch.max_model_len and arch.max_model_len_basis, key
        assert arch.kv_layer_indices, key
        assert (catalog.CONFIGS_DIR / f"{key}.json").is_file(), key


def test_every_catalog_config_has_a_sources_row():
    sources = (catalog.CONFIGS_DIR / "SOURCES.md").read_text()
    for key in catalog.catalog_ids():
        assert f"| `{key}` |" in sources, key


def test_every_gpu_entry_validates_and_fp8_compute_follows_the_generation():
    gpus = load_gpus()
    assert len(gpus) >= 20
    for key, gpu in gpus.items():
        assert key == gpu.id == key.lower()
        assert gpu.source and gpu.name
        assert gpu.fp8_compute == (gpu.generation != "ampere"), key
        if gpu.vendor == "nvidia":
            assert gpu.sm is not None and gpu.sm >= 80, key


def test_loading_is_cached():
    assert load_models() is load_models()
    assert load_gpus() is load_gpus()


BRIEF_MODELS = {
    "Llama-3.1-8B": "llama-3.1-8b",
    "Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "llama-3.1-8b": "llama-3.1-8b",
    "Llama-3.3-70B-Instruct": "llama-3.3-70b",
    "gpt-oss-20b": "gpt-oss-20b",
    "gpt-oss-120b": "gpt-oss-120b",
    "gemma-4-E2B": "gemma-4-e2b",
    "Qwen3-30B-A3B-Instruct-2507": "qwen3-30b-a3b-2507",
    "Qwen3-30B-A3B-Thinking-2507": "qwen3-30b-a3b-2507",
    "Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen3.5-27B": "qwen3.5-27b",
    "Kimi-K2.5": "kimi-k2.5",
    "MiniMax-M2.7": "minimax-m2.7",
    "DeepSeek-V3": "deepseek-v3",
    "DeepSeek-R1": "deepseek-v3",
    "Llama-3.1-70B": "llama-3.1-70b",
    "Llama-3.1-405B": "llama-3.1-405b",
    "Llama-3.2-1B": "llama-3.2-1b",
    "Llama-3.2-3B": "llama-3.2-3b",
    "Qwen3-8B": "qwen3-8b",
    "Qwen3-14B": "qwen3-14b",
    "Qwen3-32B": "qwen3-32b",
    "Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen2.5-7B": "qwen2.5-7b",
    "Qwen2.5-72B": "qwen2.5-72b",
    "Mistral-7B-v0.3": "mistral-7b-v0.3",
    "Mistral-Small-24B-Instruct-2501": "mistral-small-24b",
    "Mixtral-8x7B": "mixtral-8x7b",
    "gemma-3-4b-it": "gemma-3-4b",
    "gemma-3-12b-it": "gemma-3-12b",
    "gemma-3-27b-it": "gemma-3-27b",
}


@pytest.mark.parametrize(("name", "expected"), sorted(BRIEF_MODELS.items()))
def test_brief_and_common_models_resolve(name: str, expected: str):
    assert resolve_model(name).id == expected


def test_hf_ids_resolve_case_insensitively():
    assert resolve_model("openai/gpt-oss-20b").id == "gpt-oss-20b"
    assert resolve_model("OPENAI/GPT-OSS-20B").id == "gpt-oss-20b"
    assert resolve_model("  meta-llama/llama-3.1-8b-instruct ").id == "llama-3.1-8b"
    assert resolve_model("Qwen/Qwen3-30B-A3B-Thinking-2507").id == "qwen3-30b-a3b-2507"


@pytest.mark.parametrize(
    ("model_id", "bf16_bytes_per_token"),
    [
        # facts.yaml `derived` values (BF16 K+V over the KV-holding layers)
        ("llama-3.1-8b", 131_072),
        ("llama-3.3-70b", 327_680),
        ("qwen3-30b-a3b-2507", 98_304),
        ("qwen3.5-27b", 65_536),  # 16 full layers only
        ("kimi-k2.5", 70_272),
        ("deepseek-v3", 70_272),
        ("minimax-m2.7", 253_952),
        ("qwen3-8b", 147_456),
        ("qwen3-32b", 262_144),
        ("mistral-7b-v0.3", 131_072),
        ("llama-3.2-1b", 32_768),
        ("llama-3.2-3b", 114_688),
        ("gpt-oss-20b", 24_576 * 2),
        ("gpt-oss-120b", 36_864 * 2),
        ("gemma-3-4b", 20_480 + 118_784),
        ("gemma-3-27b", 81_920 + 425_984),
        ("gemma-4-e2b", 6_144 + 12_288),
    ],
)
def test_kv_bytes_per_token_match_the_reference(model_id: str, bf16_bytes_per_token: int):
    assert bf16_kv_bytes(model_id) == bf16_bytes_per_token


def test_gpt_oss_20b_layout():
    arch = resolve_model("gpt-oss-20b")
    assert arch.count("full") == 12 and arch.count("sliding") == 12
    assert arch.sliding_window == 128 and arch.has_attention_sinks
    # MXFP4 experts + BF16 attention/router/embeddings from the config's shapes; the checkpoint is ~13.8 GB.
    assert arch.weight_bytes == pytest.approx(13.8e9, rel=0.01)


def test_gemma4_e2b_layout():
    arch = resolve_model("gemma-4-e2b")
    assert len(arch.kv_layer_indices) == 15
    assert arch.count("sliding") == 12 and arch.count("full") == 3 and arch.count("shared") == 20
    assert (arch.head_dim, arch.full_head_dim, arch.sliding_window) == (256, 512, 512)


def test_quantized_checkpoints_are_priced_in_their_own_format():
    expected = {"gpt-oss-20b": "MXFP4", "gpt-oss-120b": "MXFP4", "kimi-k2.5": "compressed-tensors int4 group 32",
                "deepseek-v3": "fp8 128x128 blocks", "minimax-m2.7": "fp8 128x128 blocks",
                "qwen3-30b-a3b-nvfp4": "NVFP4"}
    for model_id, scheme in expected.items():
        arch = resolve_model(model_id)
        assert arch.weights_gb is None and scheme in arch.weights_basis, (model_id, arch.weights_basis)
    llama = resolve_model("llama-3.1-8b")  # BF16, and the catalog knows its safetensors total_size
    assert llama.weight_bytes == 16_060_522_496 and "total_size" in llama.weights_basis


def test_loading_one_model_parses_only_its_config(monkeypatch: pytest.MonkeyPatch):
    from kvpolicy.inputs import hfconfig

    catalog._model.cache_clear()
    seen: list[str] = []
    real = hfconfig.read_json
    monkeypatch.setattr(hfconfig, "read_json", lambda path, **kw: (seen.append(path.name), real(path, **kw))[1])
    resolve_model("qwen3-8b")
    assert [n for n in seen if not n.endswith("hf_quant_config.json")] == ["qwen3-8b.json"]
    catalog._model.cache_clear()


# -- local configs --------------------------------------------------------------------------


def test_local_folder_and_config_json_resolve_through_hfconfig():
    by_folder = resolve_model(str(FIXTURES / "gpt-oss-20b"))
    by_file = resolve_model(str(FIXTURES / "gpt-oss-20b" / "config.json"))
    assert by_folder.id == "gpt-oss-20b" and by_folder.source.endswith("config.json")
    assert by_folder == by_file


def test_relative_path_resolves(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(FIXTURES)
    assert resolve_model("./qwen3.5-27b").count("linear") == 48


def test_missing_path_says_it_looks_like_a_path():
    with pytest.raises(InputError, match="looks like a path, but no such file or folder exists"):
        resolve_model("./no/such/config.json")


# -- unknown names --------------------------------------------------------------------------


def test_unknown_model_suggests_close_ids_and_how_to_list():
    with pytest.raises(InputError) as err:
        resolve_model("llama-3.1-8")
    msg = str(err.value)
    assert "--model: unknown model `llama-3.1-8`." in msg
    assert "Did you mean" in msg and "`llama-3.1-8b`" in msg
    assert "kvpolicy models" in msg and "config.json" in msg
    assert "\n" not in msg


def test_unknown_hf_id_suggests_from_the_name_part_and_how_to_fetch():
    with pytest.raises(InputError) as err:
        resolve_model("RedHatAI/Llama-3.1-8B-Instruct-FP8")
    msg = str(err.value)
    assert "`llama-3.1-8b`" in msg
    assert ("huggingface-cli download RedHatAI/Llama-3.1-8B-Instruct-FP8 config.json model.safetensors.index.json "
            "hf_quant_config.json") in msg


def test_a_folder_with_only_config_json_counts_the_weights_from_its_shapes(tmp_path):
    # No index, no *.safetensors: the config's shapes, never 0 GB (DeepSeek-V3: 671B FP8 parameters).
    shutil.copy(Path(__file__).parent / "fixtures" / "hf" / "deepseek-v3" / "config.json", tmp_path / "config.json")
    arch = resolve_model(str(tmp_path))
    assert arch.weight_bytes == pytest.approx(resolve_model("deepseek-v3").weight_bytes, rel=0.03)
    assert arch.weight_bytes > 600e9 and arch.weight_basis.startswith("config shapes")


def test_empty_model_name():
    with pytest.raises(InputError, match="empty"):
        resolve_model("  ")


def test_unknown_gpu_suggests_and_points_to_the_list():
    with pytest.raises(InputError) as err:
        resolve_gpu("h10")
    msg = str(err.value)
    assert "--gpu: unknown GPU `h10`." in msg
    assert "Did you mean" in msg and "`h100" in msg
    assert "kvpolicy gpus" in msg


def test_where_prefix_is_used():
    with pytest.raises(InputError, match=r"^team.yaml:3: unknown GPU"):
        resolve_gpu("x9000", where="team.yaml:3")


# -- GPU names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("h100", "h100-sxm"),
        ("H100-SXM", "h100-sxm"),
        ("h100-80gb", "h100-sxm"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("a100", "a100-80gb-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000-blackwell"),
        ("mi300x", "mi300x"),
    ],
)
def test_gpu_names_resolve(name: str, expected: str):
    assert resolve_gpu(name).id == expected


def test_every_gpu_alias_and_name_resolves_to_its_entry():
    for key, gpu in load_gpus().items():
        for name in [key, gpu.name, *gpu.aliases]:
            assert resolve_gpu(name).id == key, name
            assert resolve_gpu(name.upper()).id == key, name


def test_every_model_alias_and_hf_id_resolves_to_its_entry():
    for key, arch in load_models().items():
        for name in [key, arch.hf_id, *arch.aliases]:
            assert resolve_model(name).id == key, name


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rtx 4090", "rtx-4090"),
        ("RTX-4090", "rtx-4090"),
        ("rtx4090", "rtx-4090"),
        ("RTX_4090", "rtx-4090"),
        ("  Rtx  4090 ", "rtx-4090"),
        ("NVIDIA RTX 4090", "rtx-4090"),
        ("nvidia-h100-80gb-hbm3", "h100-sxm"),
        ("H100 80GB HBM3", "h100-sxm"),
        ("h100 sxm", "h100-sxm"),
        ("rtx pro 6000", "rtx-pro-6000-blackwell"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_gpu_names_ignore_case_spaces_hyphens_and_the_vendor(name: str, expected: str):
    assert resolve_gpu(name).id == expected


@pytest.mark.parametrize(
    ("name", "expected", "count"),
    [
        ("2xh100", "h100-sxm", 2),
        ("2x h100", "h100-sxm", 2),
        ("2 x H100", "h100-sxm", 2),
        ("h100x2", "h100-sxm", 2),
        ("H100 x 4", "h100-sxm", 4),
        ("h100-x8", "h100-sxm", 8),
        ("8×h200", "h200", 8),
        ("2x rtx 4090", "rtx-4090", 2),
        ("4x NVIDIA H100 80GB HBM3", "h100-sxm", 4),
        ("mi300x", "mi300x", None),  # a catalog name is never split into a count
        ("mi300xx2", "mi300x", 2),
        ("h100", "h100-sxm", None),
    ],
)
def test_a_gpu_name_may_carry_a_count(name: str, expected: str, count: int | None):
    gpu, found = resolve_gpu_count(name)
    assert (gpu.id, found) == (expected, count)


def test_the_count_in_the_name_is_the_tp_unless_tp_is_given():
    assert gpu_and_count("2xh100", None)[1] == 2
    assert gpu_and_count("2xh100", 2)[1] == 2
    assert gpu_and_count("h100", None)[1] == 1
    assert gpu_and_count("h100", 4)[1] == 4
    with pytest.raises(InputError) as err:
        gpu_and_count("2xh100", 4)
    msg = str(err.value)
    assert "--gpu `2xh100` names 2 GPUs but --tp is 4" in msg and "drop --tp" in msg


def test_a_count_of_one_says_one_gpu():
    with pytest.raises(InputError, match=r"--gpu `1xh100` names 1 GPU but --tp is 2"):
        gpu_and_count("1xh100", 2)
    with pytest.raises(InputError, match=r"^evidence: `1xh100` names 1 GPU; name one GPU here"):
        resolve_gpu("1xh100", where="evidence")


def test_a_count_is_refused_where_one_gpu_is_meant():
    with pytest.raises(InputError, match=r"^evidence: `2xh100` names 2 GPUs; name one GPU here, e\.g\. `h100-sxm`"):
        resolve_gpu("2xh100", where="evidence")


@pytest.mark.parametrize("name", ["0xh100", "h100x2000"])
def test_a_count_out_of_range_is_refused(name: str):
    with pytest.raises(InputError, match=r"the count must be in 1\.\.1024"):
        resolve_gpu_count(name)


def test_an_unknown_gpu_with_a_count_still_suggests():
    with pytest.raises(InputError) as err:
        resolve_gpu_count("2xh1OO")
    assert "unknown GPU `2xh1OO`" in str(err.value)
    assert "Did you mean" in str(err.value)


def test_gpu_names_that_only_differ_in_spacing_collide(tmp_path: Path):
    entry = "  name: {n}\n  generation: ada\n  memory_gib: 24\n  bandwidth_tbs: 1\n  fp8_compute: true\n"
    path = tmp_path / "catalog.yaml"
    path.write_text("one:\n" + entry.format(n="RTX 9") + "two:\n" + entry.format(n="rtx-9"))
    with pytest.raises(InputError, match=r"entry `two`: the name `rtx-9` also belongs to entry `one` \(GPU names"):
        load_gpus(path)


def test_driver_reported_memory():
    assert resolve_gpu("h100").memory_gib == pytest.approx(81559 / 1024, abs=0.01)
    assert resolve_gpu("h200").memory_gib == pytest.approx(143771 / 1024, abs=0.01)
    assert resolve_gpu("a100").memory_gib == pytest.approx(81920 / 1024, abs=0.01)
    assert resolve_gpu("b200").memory_gib == pytest.approx(183359 / 1024, abs=0.01)


# -- --gpu auto -----------------------------------------------------------------------------


def fake_nvidia_smi(folder: Path, output: str) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    exe.chmod(0o755)


def test_auto_without_nvidia_smi_gives_the_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InputError, match="nvidia-smi was not found") as err:
        resolve_gpu("auto")
    assert "--gpu h100" in str(err.value)


def test_auto_matches_the_nvidia_smi_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake_nvidia_smi(tmp_path, "NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert resolve_gpu("auto").id == "h100-sxm"
    assert resolve_gpu("AUTO").id == "h100-sxm"


def test_auto_with_an_unknown_gpu_names_it_and_suggests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake_nvidia_smi(tmp_path, "NVIDIA A100 80GB PCIe\\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InputError) as err:
        resolve_gpu("auto")
    msg = str(err.value)
    assert "nvidia-smi reports `NVIDIA A100 80GB PCIe`" in msg
    assert "Did you mean" in msg and "a100" in msg
    assert "kvpolicy gpus" in msg


# -- bad catalog data -----------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(text)
    return path


def test_invalid_model_entry_names_the_file_the_entry_and_the_field(tmp_path: Path):
    path = write(tmp_path, "good:\n  hf_id: org/good\nbad:\n  aliases: [b]\n  checkpoint_bytes: -1\n")
    with pytest.raises(InputError) as err:
        load_models(path)
    msg = str(err.value)
    assert str(path) in msg and "entry `bad`" in msg
    assert "`hf_id`" in msg and "`checkpoint_bytes`" in msg and "(found -1)" in msg


def test_model_entry_without_its_config_file_names_the_file(tmp_path: Path):
    path = write(tmp_path, "lonely:\n  hf_id: org/lonely\n")
    with pytest.raises(InputError, match=r"configs/lonely\.json: file not found"):
        load_models(path)


def test_unknown_field_in_an_entry(tmp_path: Path):
    path = write(tmp_path, "x:\n  name: X\n  generation: hopper\n  memory_gib: 80\n  bandwidth_tbs: 3\n"
                 "  fp8_compute: true\n  memroy_gib: 1\n")
    with pytest.raises(InputError, match=r"entry `x` is not a valid GpuSpec: `memroy_gib`: Extra inputs"):
        load_gpus(path)


def test_duplicate_alias_names_both_entries(tmp_path: Path):
    entry = (
        "  name: {n}\n  aliases: [shared]\n  generation: ada\n  memory_gib: 24\n  bandwidth_tbs: 1\n"
        "  fp8_compute: true\n"
    )
    path = write(tmp_path, "one:\n" + entry.format(n="One") + "two:\n" + entry.format(n="Two"))
    with pytest.raises(InputError, match=r"entry `two`: the name `shared` also belongs to entry `one`"):
        load_gpus(path)


def test_catalog_ids_must_be_lower_case(tmp_path: Path):
    with pytest.raises(InputError, match="must be a non-empty lower-case string"):
        load_gpus(write(tmp_path, "H100:\n  name: x\n"))


def test_malformed_catalog_yaml_gives_the_position(tmp_path: Path):
    with pytest.raises(InputError, match=r"catalog\.yaml:3:1: malformed YAML \(did not find expected ',' or ']'\)"):
        load_models(write(tmp_path, "a:\n  b: [1, 2\n"))


# -- start-up cost --------------------------------------------------------------------------


def test_importing_the_catalog_defers_yaml_and_hfconfig():
    code = (
        "import sys, kvpolicy.inputs.catalog; "
        "print(sorted(m for m in ('ruamel.yaml', 'kvpolicy.inputs.hfconfig') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    assert out.strip() == "[]"


def test_data_files_ship_inside_the_package():
    assert catalog.MODELS_PATH.is_file() and catalog.GPUS_PATH.is_file()
    assert catalog.MODELS_PATH.parent == Path(catalog.__file__).parent / "data"


# -- catalog entries are their config.json ------------------------------------------------------


@pytest.mark.parametrize("model_id", catalog.catalog_ids())
def test_catalog_id_and_a_folder_with_its_config_give_the_same_answer(model_id: str, tmp_path: Path):
    """`--model <id>` and `--model <folder with that config.json>` recommend the same (the catalog's known
    checkpoint size travels as the folder's safetensors index)."""
    import json
    import shutil

    from kvpolicy.inputs.workload import make_workload, parse_tokens
    from kvpolicy.outputs.recommend import recommend
    from kvpolicy.rules.validate import load_policy

    entry = catalog._catalog(catalog.CatalogEntry, catalog.MODELS_PATH)[0][model_id]
    folder = tmp_path / model_id
    folder.mkdir()
    shutil.copy(catalog.CONFIGS_DIR / f"{model_id}.json", folder / "config.json")
    quant = catalog.CONFIGS_DIR / f"{model_id}.hf_quant_config.json"
    if quant.exists():
        shutil.copy(quant, folder / "hf_quant_config.json")
    if entry.checkpoint_bytes:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": entry.checkpoint_bytes}}))
    by_id, by_folder = resolve_model(model_id), resolve_model(str(folder))
    assert by_id.layers == by_folder.layers and by_id.weight_bytes == by_folder.weight_bytes
    assert (by_id.max_model_len, by_id.auto_kv_dtype, by_id.tp_rules) == \
        (by_folder.max_model_len, by_folder.auto_kv_dtype, by_folder.tp_rules)
    loaded = load_policy()
    for gpu, context in (("h100", "32k"), ("b200", "128k")):
        # Within the model's limit (above it both are refused: test_limits.py).
        workload = make_workload(loaded, context=min(parse_tokens(context), by_id.max_model_len))
        a = recommend(by_id, resolve_gpu(gpu), workload, loaded)
        b = recommend(by_folder.model_copy(update={"id": model_id, "family": by_id.family}), resolve_gpu(gpu),
                      workload, loaded)
        assert a.decision == b.decision and a.vllm_args == b.vllm_args
        assert a.estimates.kv_bytes_per_request == b.estimates.kv_bytes_per_request
        assert a.estimates.max_concurrency.value == b.estimates.max_concurrency.value


# Published totals: parameters from the model cards (huggingface.co/<hf_id>) or the research files, and
# checkpoint bytes where one is published. kvpolicy's figures come from the config's shapes and quantization.
PUBLISHED_PARAMS_B = {
    "llama-3.1-8b": (8.03, "safetensors index 16,060,522,496 B / 2 (research/configs/SOURCES.md)"),
    "llama-3.1-70b": (70.6, "meta-llama/Llama-3.1-70B-Instruct model card (70.6B)"),
    "llama-3.1-405b": (405.9, "meta-llama/Llama-3.1-405B-Instruct model card (406B)"),
    "llama-3.3-70b": (70.6, "meta-llama/Llama-3.3-70B-Instruct model card (70.6B)"),
    "llama-3.2-1b": (1.24, "meta-llama/Llama-3.2-1B-Instruct model card (1.24B)"),
    "llama-3.2-3b": (3.21, "meta-llama/Llama-3.2-3B-Instruct model card (3.21B)"),
    "llama-4-scout": (109, "meta-llama/Llama-4-Scout-17B-16E-Instruct card: 109B total (vision tower trimmed here)"),
    "gpt-oss-20b": (20.9, "openai/gpt-oss-20b card: 21B total"),
    "gpt-oss-120b": (116.8, "openai/gpt-oss-120b card: 117B total"),
    "qwen3-8b": (8.2, "Qwen/Qwen3-8B card: 8.2B"),
    "qwen3-14b": (14.8, "Qwen/Qwen3-14B card: 14.8B"),
    "qwen3-32b": (32.8, "Qwen/Qwen3-32B card: 32.8B"),
    "qwen3-30b-a3b": (30.5, "Qwen/Qwen3-30B-A3B card: 30.5B total"),
    "qwen3-30b-a3b-2507": (30.5, "Qwen/Qwen3-30B-A3B-Instruct-2507 card: 30.5B total"),
    "qwen3-30b-a3b-nvfp4": (30.5, "nvidia/Qwen3-30B-A3B-NVFP4: the 30.5B base model"),
    "qwen3-235b-a22b": (235, "Qwen/Qwen3-235B-A22B card: 235B total"),
    "qwen3-vl-235b-a22b": (236, "Qwen/Qwen3-VL-235B-A22B-Thinking: 236B (HF)"),
    "qwen3-next-80b-a3b": (80, "Qwen/Qwen3-Next-80B-A3B-Thinking card: 80B total"),
    "qwen3.5-27b": (27, "Qwen/Qwen3.5-27B card: 27B"),
    "qwen3.5-397b-a17b": (397, "Qwen/Qwen3.5-397B-A17B card: 397B total"),
    "qwen2.5-7b": (7.61, "Qwen/Qwen2.5-7B-Instruct card: 7.61B"),
    "qwen2.5-72b": (72.7, "Qwen/Qwen2.5-72B-Instruct card: 72.7B"),
    "qwen2.5-vl-7b": (8.29, "Qwen/Qwen2.5-VL-7B-Instruct: 8.29B (HF)"),
    "mistral-7b-v0.3": (7.25, "mistralai/Mistral-7B-Instruct-v0.3: 7.25B (HF)"),
    "mistral-small-24b": (23.6, "mistralai/Mistral-Small-24B-Instruct-2501: 23.6B (HF)"),
    "devstral-small-2": (24, "mistralai/Devstral-Small-2-24B-Instruct-2512 card: 24B"),
    "mixtral-8x7b": (46.7, "mistralai/Mixtral-8x7B-Instruct-v0.1: 46.7B (HF)"),
    "gemma-3-4b": (4.3, "google/gemma-3-4b-it: 4.3B (HF)"),
    "gemma-3-12b": (12.2, "google/gemma-3-12b-it: 12.2B (HF)"),
    "gemma-3-27b": (27.43, "medgemma-27b-it safetensors total_size 54,864,813,280 B / 2 (same architecture)"),
    "gemma-4-31b": (31, "google/gemma-4-31B-it card: 31B (vision tower reduced to model_type here)"),
    "phi-4": (14.7, "microsoft/phi-4 card: 14B (14.7B HF)"),
    "deepseek-v3": (671, "deepseek-ai/DeepSeek-V3 card: 671B main model + 14B MTP module"),
    "deepseek-v3.2-exp": (671, "deepseek-ai/DeepSeek-V3.2-Exp: the V3.1-Terminus architecture, 671B + MTP"),
    "kimi-k2": (1026, "moonshotai/Kimi-K2-Instruct card: 1T total (1.03T HF)"),
    "kimi-k2.5": (1026, "moonshotai/Kimi-K2.5: the Kimi-K2 text model (1T) + MoonViT"),
    "glm-4.7-flash": (30, "zai-org/GLM-4.7-Flash card: 30B-A3B"),
    "glm-5": (744, "zai-org/GLM-5 card: 744B total"),
    "glm-4.5-air": (106, "zai-org/GLM-4.5-Air card: 106B total"),
    "glm-4.7": (355, "zai-org/GLM-4.7: the GLM-4.5 architecture, 355B total"),
    "minimax-m2.7": (229, "MiniMaxAI/MiniMax-M2.7: 229B (code-index hit 61910720224, 'params: 229')"),
    "mimo-v2.5": (310.78, "report with the raw config.json (research/configs/SOURCES.md): 310,775,040,000 parameters"),
    "mimo-v2.5-pro": (1023.24, "same report series: 1,023,244,718,976 parameters"),
    "falcon-h1-7b": (7.59, "tiiuae/Falcon-H1-7B-Instruct: 7.59B (HF)"),
    "nemotron-nano-9b-v2": (8.89, "nvidia/NVIDIA-Nemotron-Nano-9B-v2: 8.89B (HF)"),
    "nemotron-h-8b": (8.1, "nvidia/Nemotron-H-8B-Base-8K card: 8B"),
    "jamba-1.5-mini": (51.6, "ai21labs/AI21-Jamba-1.5-Mini card: 52B total"),
}
PUBLISHED_GB = {
    "gpt-oss-20b": (13.8, "the studies' brief: ~13.8 GB checkpoint (MXFP4 experts)"),
    "gpt-oss-120b": (65.0, "the studies' brief: ~65 GB checkpoint"),
    "kimi-k2.5": (596, "Kimi-K2.6 card (same architecture and INT4 scheme): ~555 GiB = 596 GB"),
    "mimo-v2.5": (315.0, "293.40 GiB of safetensors (research report) = 315.0 GB"),
    "mimo-v2.5-pro": (1033.4, "962.42 GiB of safetensors (research report) = 1033.4 GB"),
    "gemma-3-27b": (54.86, "medgemma-27b-it total_size 54,864,813,280 B (same architecture)"),
}
NO_PUBLISHED = {
    "gemma-4-e2b": "the bundled config has no vision/audio towers: 4.69B of the card's 5.1B",
    "hy3": "no published size found for tencent/Hy3-FP8",
}


def test_every_catalog_model_has_a_published_size_or_a_reason():
    assert set(catalog.catalog_ids()) == set(PUBLISHED_PARAMS_B) | set(NO_PUBLISHED)


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_PARAMS_B))
def test_weights_are_within_3_percent_of_the_published_size(model_id: str):
    arch = resolve_model(model_id)
    params, source = PUBLISHED_PARAMS_B[model_id]
    assert arch.params_b == pytest.approx(params, rel=0.03), source
    if model_id in PUBLISHED_GB:
        gb, source = PUBLISHED_GB[model_id]
        assert arch.weight_bytes / 1e9 == pytest.approx(gb, rel=0.03), source
    elif "bf16" in arch.weights_basis:
        # BF16 checkpoints: 2 bytes per published parameter.
        assert arch.weight_bytes == pytest.approx(params * 2e9, rel=0.03), source
