"""Reading a GGUF file's header into a `ModelArch`, in pure Python (recommend stays torch-free).

A GGUF file starts with `GGUF`, a version (2 or 3), the tensor and metadata
counts, then typed key/value metadata (`llama.block_count`, ...) and the tensor
table. The metadata says what a Hugging Face config.json says, under other names
(`gguf-py`'s constants, which transformers' GGUF loader maps back): this module
maps it to a config dict and hands it to `arch_from_hf_config`, so a GGUF file
and the HF folder it came from give the same geometry. Weights are the tensor
data as stored (vLLM's GGUF loader keeps them quantized). Only the header is
read, never the tensor data.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from kvpolicy.errors import InputError
from kvpolicy.inputs.arch import ModelArch

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value type -> struct format (8 = string, 9 = array are read apart)."""
MAX_STRING = 1 << 24
"""Longest metadata string accepted (chat templates run to a few KB; anything near this is a corrupt file)."""

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
"""GGUF `general.architecture` -> (HF model_type, HF architecture) for the dense decoders read here."""


class _Reader:
    def __init__(self, f: BinaryIO, where: str) -> None:
        self.f, self.where = f, where

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise InputError(f"{self.where}: the GGUF header ends early (truncated download?). Fetch the file again.")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.take("<Q")
        if n > MAX_STRING:
            raise InputError(f"{self.where}: a GGUF string claims {n:,} bytes; the file is corrupt.")
        raw = self.f.read(n)
        if len(raw) != n:
            raise InputError(f"{self.where}: the GGUF header ends early (truncated download?). Fetch the file again.")
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALARS and not keep:  # skip big arrays (token scores) without unpacking them
                self.f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
                return count
            items = [self.value(etype, keep) for _ in range(count)]
            return items if keep else count
        raise InputError(f"{self.where}: unknown GGUF value type {vtype}; the file is corrupt or from a newer "
                         "GGUF version than kvpolicy reads (2 and 3).")


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, list[int]], int]:
    """(metadata, tensor name -> shape, offset where tensor data starts) of a GGUF file.

    `tokenizer.*` arrays are replaced by their length (the vocabulary is all kvpolicy needs of them).
    """
    where = str(path)
    try:
        f = path.open("rb")
    except OSError as exc:
        raise InputError(f"{where}: cannot be opened ({exc.strerror}). Check the path and its permissions.") from None
    with f:
        if f.read(4) != MAGIC:
            raise InputError(f"{where}: not a GGUF file (it does not start with `GGUF`). Pass a .gguf model file, "
                             "a Hugging Face folder or config.json, or a catalog model.")
        r = _Reader(f, where)
        version = r.take("<I")
        if version not in (2, 3):
            raise InputError(f"{where}: GGUF version {version}; kvpolicy reads versions 2 and 3.")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            vtype = r.take("<I")
            meta[key] = r.value(vtype, keep=not key.startswith("tokenizer.ggml."))
        tensors: dict[str, list[int]] = {}
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.take("<Q") for _ in range(r.take("<I"))]
            r.take("<I")  # ggml type
            r.take("<Q")  # offset
            tensors[name] = dims
        align = int(meta.get("general.alignment", 32) or 32)
        start = f.tell()
        start += (-start) % align
    return meta, tensors, start


def _per_layer(value: Any, key: str, where: str) -> int:
    """A head count that GGUF may store per layer (an array): one value when they agree."""
    if isinstance(value, list):
        distinct = sorted({int(v) for v in value if int(v) > 0})
        if len(distinct) != 1:
            raise InputError(f"{where}: `{key}` differs per layer ({distinct}); kvpolicy reads GGUF models with one "
                             "head count. Use the model's Hugging Face folder instead.")
        return distinct[0]
    return int(value)


def gguf_config(meta: dict[str, Any], tensors: dict[str, list[int]], where: str) -> dict[str, Any]:
    """The Hugging Face config.json a GGUF header stands for (the keys kvpolicy reads)."""
    arch = str(meta.get("general.architecture") or "")
    if arch not in ARCHITECTURES:
        raise InputError(f"{where}: GGUF architecture `{arch or '(missing)'}` is not one kvpolicy maps to a "
                         f"Hugging Face config ({', '.join(ARCHITECTURES)}). Pass the model's Hugging Face folder "
                         "(config.json) instead.")
    model_type, arch_name = ARCHITECTURES[arch]

    def get(key: str, required: bool = True) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None and required:
            raise InputError(f"{where}: GGUF metadata `{arch}.{key}` is missing; the file's header is incomplete.")
        return value

    heads = _per_layer(get("attention.head_count"), f"{arch}.attention.head_count", where)
    kv = get("attention.head_count_kv", required=False)
    hidden = int(get("embedding_length"))
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [arch_name],
        "num_hidden_layers": int(get("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads if kv is None else _per_layer(kv, f"{arch}.attention.head_count_kv", where),
        "head_dim": int(get("attention.key_length", required=False) or hidden // heads),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(get("vocab_size", required=False) or meta.get("tokenizer.ggml.tokens") or 0) or None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "bfloat16",
    }
    if (v := get("attention.value_length", required=False)) and int(v) != cfg["head_dim"]:
        cfg["v_head_dim"] = int(v)
    if (theta := get("rope.freq_base", required=False)) is not None:
        cfg["rope_theta"] = float(theta)
    if (window := get("attention.sliding_window", required=False)):
        cfg["sliding_window"] = int(window)
    return {k: v for k, v in cfg.items() if v is not None}


def load_gguf(path: str | Path, *, model_id: str | None = None) -> ModelArch:
    """Read a .gguf file's header into a ModelArch (the model id is the file name without `.gguf`)."""
    from kvpolicy.inputs.hfconfig import arch_from_hf_config

    path = Path(path).expanduser()
    meta, tensors, data_start = read_header(path)
    where = str(path)
    cfg = gguf_config(meta, tensors, where)
    size = path.stat().st_size - data_start
    ftype = meta.get("general.file_type")
    basis = f"GGUF tensor data in {path.name} ({size:,} bytes, as stored: vLLM's GGUF loader keeps them quantized" \
            + (f", file type {ftype})" if ftype is not None else ")")
    return arch_from_hf_config(cfg, model_id or path.name.removesuffix(".gguf"), where,
                               checkpoint_bytes=(size, basis))


def gguf_in(folder: Path) -> Path | None:
    """The one .gguf file of a folder without config.json (None when there is none)."""
    if not folder.is_dir() or (folder / "config.json").is_file():
        return None
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        raise InputError(f"{folder}: holds {len(files)} .gguf files ({', '.join(p.name for p in files[:4])}); "
                         "pass the one to use.")
    return files[0] if files else None
