"""Hugging Face config.json -> ModelArch: layouts, KV bytes, and errors that name the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvpolicy.errors import InputError
from kvpolicy.facts.kv_memory import layer_kv_bytes_per_token
from kvpolicy.formats import FORMATS
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


def test_one_listed_layer_is_one_layer():
    with pytest.raises(InputError, match="lists 1 layer but num_hidden_layers is 8"):
        make(**BASE, layer_types=["full_attention"])


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


# -- per-layer geometry as vLLM's models read it ----------------------------------------------


def test_gemma4_full_layers_take_the_global_heads_and_head_dim():
    arch = fixture("gemma-4-31b-it")
    full, sliding = arch.layer(5), arch.layer(0)
    assert (full.kind, full.num_kv_heads, full.head_size, full.head_size_v) == ("full", 4, 512, 512)
    assert (sliding.kind, sliding.num_kv_heads, sliding.head_size, sliding.window) == ("sliding", 16, 256, 1024)
    assert arch.head_sizes == frozenset({256, 512})


def test_mimo_swa_layers_have_their_own_heads_and_value_dim():
    arch = fixture("mimo-v2.5")
    swa, full = arch.layer(1), arch.layer(0)
    assert (swa.kind, swa.num_kv_heads, swa.head_size, swa.head_size_v, swa.window) == ("sliding", 8, 192, 128, 128)
    assert (full.kind, full.num_kv_heads, full.head_size, full.head_size_v) == ("full", 4, 192, 128)
    assert arch.has_attention_sinks  # add_swa_attention_sink_bias


def test_llama4_nope_layers_are_global_and_the_rest_chunked():
    arch = fixture("llama-4-scout-17b-16e-instruct")
    assert [s.index for s in arch.layers if s.kind == "full"] == list(range(3, 48, 4))
    assert {s.chunk for s in arch.layers if s.kind == "chunked"} == {8192}
    assert arch.layer_types.count("full") == 48  # the summary counts chunked layers as full attention


def test_falcon_h1_has_attention_and_mamba_in_every_layer_and_is_hybrid():
    arch = fixture("falcon-h1-0.5b")
    assert arch.count("full") == 36 and arch.count("mamba") == 36
    assert arch.is_hybrid and arch.has_recurrent_state
    state = next(s.state for s in arch.layers if s.state)
    assert state.shapes(1) == ((3, 1536 + 2 * 128), (24, 64, 128)) and state.dtypes() == ("bfloat16", "bfloat16")


def test_sparse_mla_has_an_indexer_in_every_layer():
    arch = fixture("deepseek-v3.2-exp-ptpc")
    assert arch.is_sparse_mla and all(s.indexer_head_dim == 128 for s in arch.layers)
    assert not fixture("deepseek-v3").is_sparse_mla


def test_gdn_and_mamba_state_dtypes_follow_vllm():
    nemotron = next(s.state for s in fixture("nemotron-h-8b").layers if s.state)
    assert nemotron.dtypes() == ("bfloat16", "float32")  # NemotronH: mamba_ssm_cache_dtype float32 by default
    qwen_next = next(s.state for s in fixture("qwen3-next-80b-a3b-thinking").layers if s.state)
    assert qwen_next.dtypes() == ("bfloat16", "bfloat16")  # not in MODELS_CONFIG_MAP: the model dtype
    assert qwen_next.shapes(1) == ((3, 2 * 16 * 128 + 32 * 128), (32, 128, 128))
    config = json.loads((FIXTURES / "qwen3.5-27b" / "config.json").read_text())
    config["text_config"]["mamba_ssm_dtype"] = "float32"
    qwen35 = next(s.state for s in arch_from_hf_config(config, "q", "x").layers if s.state)
    assert qwen35.dtypes() == ("bfloat16", "float32")  # Qwen3.5 copies mamba_ssm_dtype


FAMILIES = {
    "llama-3.1-8b-instruct": "llama", "llama-4-scout-17b-16e-instruct": "llama", "gpt-oss-20b": "gpt-oss",
    "glm-4.5-air": "glm", "glm-4.7-flash": "glm", "glm-5-fp8": "glm", "phi-4": "phi", "qwen2.5-vl-7b-instruct": "qwen2",
    "qwen3-vl-235b-a22b-thinking": "qwen3", "qwen3-30b-a3b": "qwen3", "qwen3-next-80b-a3b-thinking": "qwen3.5",
    "qwen3.5-27b": "qwen3.5", "qwen3.5-397b-a17b": "qwen3.5", "mimo-v2.5": "mimo", "falcon-h1-7b-instruct": "falcon",
    "ai21-jamba-1.5-mini": "jamba", "nemotron-h-8b": "nemotron", "minimax-m2": "minimax", "kimi-k2-instruct": "kimi",
    "kimi-k2.5": "kimi", "deepseek-v3.2-exp-ptpc": "deepseek", "gemma-3-12b-it": "gemma", "gemma-4-31b-it": "gemma",
    "devstral-small-2-24b-instruct": "mistral", "mixtral-8x7b": "mistral", "hy3-fp8": "hunyuan",
}


@pytest.mark.parametrize(("folder", "family"), sorted(FAMILIES.items()))
def test_every_fixture_model_type_maps_to_a_family(folder: str, family: str):
    assert fixture(folder).family == family


@pytest.mark.parametrize("folder", sorted(p.name for p in (Path(__file__).parent / "fixtures" / "hf").iterdir()
                                          if (p / "config.json").is_file() and not p.name.startswith("broken")))
def test_no_fixture_falls_back_to_its_raw_model_type(folder: str):
    # An unmapped model_type becomes its own "family", which no family rule or pin would ever match.
    from kvpolicy.inputs.hfconfig import FAMILIES as KNOWN

    arch = fixture(folder)
    assert arch.family in set(KNOWN.values()), (folder, arch.model_type, arch.family)


# -- limits vLLM derives --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("folder", "limit"),
    [
        ("phi-4", 16384), ("mistral-7b-instruct-v0.3", 32768), ("qwen3-30b-a3b", 40960),
        ("qwen3-30b-a3b-instruct-2507", 262144), ("llama-3.1-8b-instruct", 131072),  # llama3 factor not applied
        ("gpt-oss-20b", 131072), ("deepseek-v3", 163840),  # yarn factor not applied
        ("gemma-3-12b-it", 131072),  # Gemma-3: linear factor 8 not applied
        ("qwen2.5-vl-7b-instruct", 128000), ("llama-4-scout-17b-16e-instruct", 10485760),
        ("devstral-small-2-24b-instruct", 393216), ("nemotron-h-8b", 8192), ("falcon-h1-0.5b", 16384),
    ],
)
def test_max_model_len_as_vllm_derives_it(folder: str, limit: int):
    arch = fixture(folder)
    assert arch.max_model_len == limit, arch.max_model_len_basis
    assert "max_position_embeddings" in arch.max_model_len_basis


def test_rope_factors_that_count_and_those_that_do_not():
    assert make(**BASE, max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 4.0}).max_model_len \
        == 16384
    assert make(**BASE, max_position_embeddings=4096, rope_scaling={"rope_type": "dynamic", "factor": 2}) \
        .max_model_len == 8192
    assert make(**BASE, max_position_embeddings=32768, rope_scaling={"type": "yarn", "factor": 4}).max_model_len \
        == 32768
    assert make(**BASE, max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", "factor": 8}) \
        .max_model_len == 131072
    longrope = make(**BASE, max_position_embeddings=131072, original_max_position_embeddings=4096,
                    rope_scaling={"type": "su", "factor": 32})
    assert longrope.max_model_len == 131072 and "original_max_position_embeddings=4096" in longrope.max_model_len_basis
    # The smallest key wins; model_max_length overrides.
    assert make(**BASE, max_position_embeddings=8192, seq_length=4096).max_model_len == 4096
    cohere = make(**BASE, max_position_embeddings=8192, model_max_length=131072)
    assert cohere.max_model_len == 131072 and cohere.max_model_len_basis.startswith("model_max_length")
    assert make(**BASE).max_model_len == 2048  # no key at all


@pytest.mark.parametrize(
    ("folder", "tp", "ok"),
    [
        ("llama-3.1-8b-instruct", 3, False),  # 32 heads, 8 KV heads: 3 divides neither
        ("llama-3.1-8b-instruct", 16, True),  # 16 > 8 KV heads: replicated
        ("phi-4", 8, False),  # 10 KV heads
        ("phi-4", 2, True),
        ("qwen2.5-vl-7b-instruct", 8, False),  # 28 query heads
        ("gpt-oss-20b", 16, False),  # gpt-oss divides KV heads without max(1, ...)
        ("gpt-oss-20b", 8, True),
        ("qwen3-next-80b-a3b-thinking", 32, False),  # 16 attention heads; GDN key heads 16
        ("qwen3-next-80b-a3b-thinking", 8, True),
        ("falcon-h1-7b-instruct", 8, False),  # 12 attention heads
        ("nemotron-h-8b", 8, True),
        ("deepseek-v3", 16, True),  # MLA: only the 128 query heads count
        ("deepseek-v3", 3, False),
    ],
)
def test_tp_rules_follow_vllm(folder: str, tp: int, ok: bool):
    arch = fixture(folder)
    err = arch.tp_error(tp)
    assert (err is None) == ok, err
    if not ok:
        assert f"--tp {tp}" in err and "Valid tensor-parallel sizes" in err
        assert str(tp) not in err.split("sizes up to")[1].split(":")[1].split(", ")


def test_valid_tp_sizes():
    assert fixture("llama-3.1-8b-instruct").valid_tp_sizes(16) == [1, 2, 4, 8, 16]
    assert fixture("phi-4").valid_tp_sizes(8) == [1, 2, 5]  # 40 query and 10 KV heads
    assert fixture("gpt-oss-20b").valid_tp_sizes(16) == [1, 2, 4, 8]


# -- the checkpoint's KV scheme ---------------------------------------------------------------------


def test_modelopt_hf_quant_config_turns_auto_into_fp8():
    arch = fixture("qwen3-30b-a3b-nvfp4")
    assert arch.kv_cache_scheme is not None and arch.kv_cache_scheme.algo == "FP8"
    assert "hf_quant_config.json" in arch.kv_cache_scheme.source
    assert arch.auto_kv_dtype == "fp8_e4m3"
    assert "NVFP4" in arch.weights_basis


def test_fp8_checkpoint_with_static_kv_scales_keeps_auto_as_the_model_dtype():
    arch = fixture("hy3-fp8")
    assert arch.kv_cache_scheme is not None and arch.kv_cache_scheme.method == "fp8"
    assert arch.auto_kv_dtype == "auto" and "--kv-cache-dtype fp8" in arch.auto_kv_basis


def test_compressed_tensors_attn_head_scheme_is_read():
    cfg = {**BASE, "quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}}}
    arch = make(**cfg)
    assert arch.kv_cache_scheme.strategy == "attn_head" and arch.auto_kv_dtype == "fp8"
    assert make(**BASE).kv_cache_scheme is None and make(**BASE).auto_kv_dtype == "auto"


def test_modelopt_inline_nvfp4_kv_scheme():
    cfg = {**BASE, "quantization_config": {"quant_method": "modelopt", "producer": {"name": "modelopt"},
                                           "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "NVFP4"}}}
    assert make(**cfg).auto_kv_dtype == "nvfp4"


# -- weights: each scheme's bytes per element -----------------------------------------------------


@pytest.mark.parametrize(
    ("quant", "n", "k", "expected"),
    [
        # fp8 128x128 blocks: 1 byte + one fp32 scale per block (Fp8LinearMethod).
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 4096, 4096, 4096 * 4096 + 4 * 32 * 32),
        ({"quant_method": "fp8"}, 4096, 4096, 4096 * 4096 + 4),
        # GPTQ / AWQ 4-bit group 128: packed codes, fp16 scales and packed zeros per group.
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, 4096, 4096,
         4096 * 4096 // 2 + 2 * 4096 * 32 + 4096 * 32 // 2),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, 4096, 4096,
         4096 * 4096 // 2 + 2 * 4096 * 32 + 4096 * 32 // 2),
        # compressed-tensors W4A16 symmetric group 32 (Kimi-K2.5): no zero points.
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "group_size": 32, "strategy": "group", "symmetric": True}}}},
         4096, 4096, 4096 * 4096 // 2 + 2 * 4096 * 128),
        # NVFP4: E2M1 codes + one E4M3 scale per 16 + fp32 globals.
        ({"quant_method": "modelopt_fp4"}, 4096, 4096, 4096 * 4096 // 2 + 4096 * 4096 // 16 + 8),
    ],
)
def test_quantized_linear_bytes(quant: dict, n: int, k: int, expected: int):
    from kvpolicy.inputs.hf_weights import scheme

    assert scheme({**quant, "quant_method": quant["quant_method"]}).linear_bytes(n, k) == expected


def test_ignore_lists_keep_modules_in_bf16():
    from kvpolicy.inputs.hf_weights import Module, scheme, weights_bytes

    mods = [Module("model.layers.0.self_attn.q_proj", linears=[(1024, 1024)]),
            Module("model.layers.0.mlp.experts", linears=[(1024, 1024)], count=4, experts=True),
            Module("lm_head", linears=[(1024, 1024)])]
    fp8 = scheme({"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.q_proj"]})
    assert weights_bytes(mods, fp8)[0] == 2 * 1024 * 1024 + 4 * (1024 * 1024 + 4) + 2 * 1024 * 1024
    mx = scheme({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]})
    assert weights_bytes(mods, mx)[0] == 2 * 1024 * 1024 + 4 * (1024 * 1024 // 2 + 1024 * 1024 // 32) + 2 * 1024 * 1024
    ct = scheme({"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*self_attn.*"],
                 "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 32}}}})
    assert weights_bytes(mods, ct)[0] == 2 * 1024 * 1024 + 4 * (1024 * 1024 // 2 + 2 * 1024 * 32) + 2 * 1024 * 1024
