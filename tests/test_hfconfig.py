"""Hugging Face config.json -> ModelArch: layouts, KV bytes, and errors that name the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvpolicy.errors import InputError
from kvpolicy.facts.formats import FORMATS
from kvpolicy.facts.kv_memory import layer_kv_bytes_per_token
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.catalog import resolve_model
from kvpolicy.inputs.hfconfig import arch_from_hf_config, load_hf_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
BF16 = FORMATS["auto"]


def kv_bytes(arch: ModelArch, kind: str | None = None) -> int:
    """BF16 bytes per token summed over the layers (of one kind, when given)."""
    return sum(
        layer_kv_bytes_per_token(arch, i, BF16)
        for i in range(arch.num_layers)
        if kind is None or arch.layer_types[i] == kind
    )


def fixture(name: str) -> ModelArch:
    return load_hf_config(FIXTURES / name)


def make(**keys: Any) -> ModelArch:
    return arch_from_hf_config(keys, "test-model", "test/config.json")


# -- real-shaped fixtures -------------------------------------------------------------------


def test_llama_31_8b_is_32_full_gqa_layers_of_4_kib():
    arch = fixture("llama-3.1-8b-instruct")
    assert arch.id == "llama-3.1-8b-instruct"
    assert arch.layer_types == ["full"] * 32
    assert (arch.num_kv_heads, arch.head_dim, arch.attention) == (8, 128, "gqa")  # head_dim from 4096 / 32
    assert kv_bytes(arch) == 131_072
    assert arch.family == "llama" and arch.max_position_embeddings == 131072


def test_gpt_oss_20b_alternates_sliding_and_full_with_sinks():
    arch = fixture("gpt-oss-20b")
    assert arch.layer_types[:2] == ["sliding", "full"]
    assert arch.count("full") == 12 and arch.count("sliding") == 12
    assert arch.sliding_window == 128
    assert arch.has_attention_sinks
    assert kv_bytes(arch, "full") == 24_576
    assert kv_bytes(arch, "sliding") == 24_576
    assert arch.family == "gpt-oss"


def test_gemma3_sliding_window_pattern_puts_every_sixth_layer_global():
    arch = fixture("gemma-3-12b-it")  # nested under text_config
    assert [i for i, t in enumerate(arch.layer_types) if t == "full"] == [5, 11, 17, 23, 29, 35, 41, 47]
    assert arch.sliding_window == 1024
    assert (arch.num_kv_heads, arch.head_dim) == (8, 256)
    assert kv_bytes(arch, "full") == 65_536  # facts.yaml derived value
    assert kv_bytes(arch, "sliding") == 327_680


def test_gemma3_4b_minimal_text_config_takes_the_transformers_defaults():
    arch = fixture("gemma-3-4b-it")
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (8, 4, 256)
    assert arch.count("full") == 5 and arch.count("sliding") == 29
    assert arch.max_position_embeddings == 131072
    assert kv_bytes(arch, "full") == 20_480 and kv_bytes(arch, "sliding") == 118_784


def test_gemma4_e2b_shares_kv_from_layer_15_and_uses_global_head_dim():
    arch = fixture("gemma-4-e2b")
    assert len(arch.kv_layer_indices) == 15
    assert arch.layer_types[15:] == ["shared"] * 20
    assert arch.layer_types[:15] == (["sliding"] * 4 + ["full"]) * 3
    assert (arch.head_dim, arch.full_head_dim, arch.sliding_window) == (256, 512, 512)
    assert arch.attention == "mqa"
    assert layer_kv_bytes_per_token(arch, 0, BF16) == 1024  # 1 KV head x (256 + 256) x 2 B
    assert layer_kv_bytes_per_token(arch, 4, BF16) == 2048  # full layer: head_dim 512
    assert kv_bytes(arch, "full") == 6144 and kv_bytes(arch, "sliding") == 12_288
    assert arch.family == "gemma"


def test_qwen35_27b_keeps_kv_only_in_its_16_full_layers():
    arch = fixture("qwen3.5-27b")
    assert arch.count("linear") == 48 and arch.count("full") == 16
    assert arch.layer_types[:4] == ["linear", "linear", "linear", "full"]
    assert kv_bytes(arch) == 65_536
    assert arch.is_hybrid and arch.family == "qwen3.5"


def test_deepseek_v3_is_mla_with_one_latent_per_token():
    arch = fixture("deepseek-v3")
    assert arch.attention == "mla" and arch.layer_types == ["mla"] * 61
    assert (arch.kv_lora_rank, arch.qk_rope_head_dim, arch.head_dim, arch.v_head_dim) == (512, 64, 192, 128)
    assert kv_bytes(arch) == 70_272
    assert layer_kv_bytes_per_token(arch, 0, FORMATS["fp8"]) == 576


def test_kimi_k25_reads_the_nested_mla_text_config():
    arch = fixture("kimi-k2.5")
    assert arch.attention == "mla" and arch.num_layers == 61
    assert kv_bytes(arch) == 70_272
    assert arch.family == "kimi"
    assert arch.max_position_embeddings == 262144


def test_nemotron_h_pattern_keeps_kv_only_in_attention_blocks():
    arch = fixture("nemotron-h-8b")
    assert arch.num_layers == 52
    assert [i for i, t in enumerate(arch.layer_types) if t == "full"] == [7, 18, 29, 40]
    assert arch.layer_types.count("linear") == 48  # Mamba-2 and MLP-only blocks: no per-token KV
    assert arch.count("mamba") == 24 and arch.count("none") == 24 and arch.count("linear") == 24
    assert arch.head_dim == 128  # attention_head_dim
    assert kv_bytes(arch) == 4 * 8 * 256 * 2


def test_folder_and_config_json_path_give_the_same_arch():
    assert load_hf_config(FIXTURES / "gpt-oss-20b") == load_hf_config(FIXTURES / "gpt-oss-20b" / "config.json")


def test_weights_come_from_the_safetensors_index_when_present(tmp_path: Path):
    shutil.copy(FIXTURES / "llama-3.1-8b-instruct" / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16_060_522_496}}))
    indexed = load_hf_config(tmp_path)
    assert indexed.weight_bytes == 16_060_522_496 and "total_size" in indexed.weights_basis
    # Without an index: the config's shapes in BF16 give the same 8.03B parameters x 2 bytes.
    shapes = load_hf_config(FIXTURES / "llama-3.1-8b-instruct")
    assert shapes.weight_bytes == 16_060_522_496 and "config shapes" in shapes.weights_basis
    assert shapes.weights_gb is None


# -- the catalog and the config agree -------------------------------------------------------

KV_LAYOUT = (
    "num_layers", "layer_types", "num_attention_heads", "num_kv_heads", "head_dim", "v_head_dim",
    "full_head_dim", "sliding_window", "attention", "kv_lora_rank", "qk_rope_head_dim",
    "has_attention_sinks", "max_position_embeddings", "family",
)


@pytest.mark.parametrize(
    ("folder", "catalog_id"),
    [
        ("llama-3.1-8b-instruct", "llama-3.1-8b"),
        ("gpt-oss-20b", "gpt-oss-20b"),
        ("gemma-3-12b-it", "gemma-3-12b"),
        ("gemma-3-4b-it", "gemma-3-4b"),
        ("gemma-4-e2b", "gemma-4-e2b"),
        ("qwen3.5-27b", "qwen3.5-27b"),
        ("deepseek-v3", "deepseek-v3"),
        ("kimi-k2.5", "kimi-k2.5"),
    ],
)
def test_catalog_entry_matches_its_hf_config(folder: str, catalog_id: str):
    from_config = fixture(folder)
    from_catalog = resolve_model(catalog_id)
    for field in KV_LAYOUT:
        assert getattr(from_config, field) == getattr(from_catalog, field), field


# -- layouts from other config spellings ----------------------------------------------------

BASE = {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 1024}


def test_missing_num_key_value_heads_means_mha():
    arch = make(**{k: v for k, v in BASE.items() if k != "num_key_value_heads"})
    assert arch.num_kv_heads == 8 and arch.attention == "mha"
    assert arch.head_dim == 128


def test_explicit_head_dim_wins_over_hidden_size():
    assert make(**BASE, head_dim=64).head_dim == 64


def test_qwen2_use_sliding_window_false_means_no_sliding():
    arch = make(**BASE, model_type="qwen2", sliding_window=131072, use_sliding_window=False, max_window_layers=8)
    assert arch.layer_types == ["full"] * 8 and arch.sliding_window is None


def test_qwen2_use_sliding_window_true_slides_from_max_window_layers():
    arch = make(**BASE, model_type="qwen2", sliding_window=4096, use_sliding_window=True, max_window_layers=6)
    assert arch.layer_types == ["full"] * 6 + ["sliding"] * 2


def test_mistral_v01_window_applies_to_every_layer():
    arch = make(**BASE, model_type="mistral", sliding_window=4096)
    assert arch.layer_types == ["sliding"] * 8 and arch.sliding_window == 4096


def test_null_sliding_window_means_full_attention():
    assert make(**BASE, model_type="mistral", sliding_window=None).layer_types == ["full"] * 8


def test_gemma2_alternates_without_an_explicit_pattern():
    arch = make(**BASE, model_type="gemma2", sliding_window=4096)
    assert arch.layer_types == ["sliding", "full"] * 4


def test_underscored_sliding_window_pattern_is_read():
    arch = make(**BASE, sliding_window=512, _sliding_window_pattern=4)
    assert arch.layer_types == ["sliding"] * 3 + ["full"] + ["sliding"] * 3 + ["full"]


def test_jamba_attention_period_and_offset():
    arch = make(**BASE, model_type="jamba", attn_layer_period=8, attn_layer_offset=4)
    assert [i for i, t in enumerate(arch.layer_types) if t == "full"] == [4]
    assert arch.count("linear") == 7


def test_granite_hybrid_layer_types_mamba_and_attention():
    arch = make(**BASE, model_type="granitemoehybrid", layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 4)
    assert arch.layer_types.count("full") == 1 and arch.count("linear") == 7
    assert arch.family == "granite"


def test_layers_block_type_list():
    arch = make(**BASE, model_type="jamba", layers_block_type=["mamba", "mamba", "attention", "mamba"] * 2)
    assert arch.layer_types == ["linear", "linear", "full", "linear"] * 2
    assert arch.count("mamba") == 6 and arch.layer(0).state.type == "mamba1"


def test_qwen3_next_full_attention_interval_without_a_list():
    arch = make(**BASE, model_type="qwen3_next", full_attention_interval=4, linear_num_value_heads=32)
    assert arch.layer_types == ["linear", "linear", "linear", "full"] * 2


def test_gpt_oss_architecture_name_alone_marks_sinks():
    arch = make(**BASE, architectures=["GptOssForCausalLM"], sliding_window=128)
    assert arch.has_attention_sinks
    assert not make(**BASE, model_type="llama").has_attention_sinks


# -- errors ---------------------------------------------------------------------------------


def test_missing_num_hidden_layers_names_the_file_the_key_and_the_fix():
    path = FIXTURES / "broken-no-layers"
    with pytest.raises(InputError) as err:
        load_hf_config(path)
    msg = str(err.value)
    assert str(path / "config.json") in msg
    assert "`num_hidden_layers`" in msg
    assert "kvpolicy models" in msg


def test_missing_key_in_nested_config_says_where():
    with pytest.raises(InputError, match=r"x\.json \(text_config\): required key `num_attention_heads`"):
        arch_from_hf_config({"text_config": {"num_hidden_layers": 4}}, "m", "x.json")


def test_invalid_json_gives_line_and_column(tmp_path: Path):
    bad = tmp_path / "config.json"
    bad.write_text('{\n  "num_hidden_layers": 32,\n  "oops"\n}\n')
    with pytest.raises(InputError, match=r"config\.json:4:1: invalid JSON \(Expecting ':' delimiter\)"):
        load_hf_config(tmp_path)


def test_json_that_is_not_an_object(tmp_path: Path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="expected a JSON object"):
        load_hf_config(tmp_path)


def test_folder_without_config_json(tmp_path: Path):
    with pytest.raises(InputError, match="has no config.json"):
        load_hf_config(tmp_path)


def test_missing_file():
    with pytest.raises(InputError, match="file not found"):
        load_hf_config(FIXTURES / "nope" / "config.json")


def test_layer_types_length_must_match():
    with pytest.raises(InputError, match="lists 3 layers but num_hidden_layers is 8"):
        make(**BASE, layer_types=["full_attention"] * 3)


def test_unknown_layer_kind_is_named_with_the_known_ones():
    with pytest.raises(InputError, match=r"`layer_types\[1\]` is 'wobbly_attention'.*full_attention"):
        make(**BASE, layer_types=["full_attention", "wobbly_attention"] + ["full_attention"] * 6)


def test_sliding_layers_without_a_window():
    with pytest.raises(InputError, match="`sliding_window`"):
        make(**BASE, layer_types=["sliding_attention", "full_attention"] * 4)


def test_bad_numbers_are_reported():
    with pytest.raises(InputError, match="`num_attention_heads` is 'eight'"):
        make(num_hidden_layers=2, num_attention_heads="eight", hidden_size=64)
    with pytest.raises(InputError, match="num_kv_shared_layers"):
        make(**BASE, num_kv_shared_layers=8)
