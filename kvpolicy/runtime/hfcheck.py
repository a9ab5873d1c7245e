"""Model-level check: run a local Hugging Face model with its KV cache stored through our kernels.

Every attention layer's K/V go through the store kernel into a paged cache in
that layer's format (the variant's `Layout`), and attention reads them back
through the decode kernel: the T positions of the text are T one-token
sequences over the same pages with lengths 1..T, which is causal attention over
the stored cache. The next-token distributions are compared with those of the
BF16 cache (next-token agreement, KL divergence); the BF16 run is itself
compared with the model's own attention, which checks the hook.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvpolicy.errors import InputError
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.runtime import ops
from kvpolicy.runtime.caches import LayerPlan, allocate, plan_layers, slots_for
from kvpolicy.runtime.variants import Variant
from kvpolicy.runtime.verify import ModelCheck

ATTN_NAME = "kvpolicy"
"""Name our attention function is registered under in transformers."""
DEFAULT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
    "screw press, movable metal type and an oil-based ink into a system that could produce books faster than "
    "any scribe. Within fifty years presses were running in more than two hundred cities across Europe, and the "
    "price of a book fell so far that merchants, students and artisans could own them. Ideas travelled with "
    "the books: scientific observations were checked and corrected by readers far away, religious arguments "
    "spread in pamphlets, and vernacular languages gained standard spellings. Historians still debate how much "
    "of the scientific revolution and the reformation depended on printing, but few doubt that cheap copies "
    "changed who could take part in learning."
)
"""Text used when no --text file is given and the folder has a tokenizer."""
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def has_weights(path: Path) -> bool:
    """True when `path` is a folder holding model weights."""
    return path.is_dir() and any(next(path.glob(p), None) for p in WEIGHT_PATTERNS)


class _State:
    """What the registered attention function reads: the plans of the run in progress."""

    plans: list[LayerPlan] | None = None
    variant: Variant | None = None
    backend: str = "reference"
    device: torch.device | None = None


_STATE = _State()


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
               s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: store K/V in the layer's format, attend causally through the decode kernel."""
    plans, variant = _STATE.plans, _STATE.variant
    assert plans is not None and variant is not None
    plan = plans[module.layer_idx]
    if plan.fmt is None:
        src = plans[plan.source] if plan.source is not None else None
        if src is None or src.fmt is None:
            raise InputError(f"layer {module.layer_idx} ({plan.kind}) has no cache of its own to store into.")
        plan = replace(plan, fmt=src.fmt, bytes_per_token=src.bytes_per_token)
    batch, hq, t, d = query.shape
    if batch != 1:
        raise InputError("the model-level check runs one sequence at a time")
    if key.shape[-1] != d or value.shape[-1] != d:
        raise InputError(f"layer {module.layer_idx}: query/key/value head dims {d}/{key.shape[-1]}/"
                         f"{value.shape[-1]} differ (MLA models run un-absorbed in transformers); the "
                         "model-level check needs K and V of one head dim.")
    hkv = key.shape[1]
    window = sliding_window or None
    plan = replace(plan, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, out_dim=d, window=window,
                   sm_scale=float(scaling if scaling is not None else d**-0.5), has_sinks=s_aux is not None)
    cache = allocate([plan], 1, t, query.device)[0]
    assert cache is not None
    if s_aux is not None:
        cache.sinks = s_aux.detach().to(torch.float32).contiguous()
    slots = slots_for(torch.arange(t, device=query.device), cache.block_tables).reshape(t)
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    if variant.kind == "fp8" and variant.scale_source != "uncalibrated" and plan.fmt.kind == "fp8":
        from kvpolicy.kernels.paged_store import compute_kv_scales

        cache.k_scale, cache.v_scale = compute_kv_scales(k, v, variant.scale_source != "checkpoint_per_tensor")
    ops.store(cache, k, v, slots, _STATE.backend)
    q = query[0].transpose(0, 1).contiguous()
    tables = cache.block_tables.expand(t, -1).contiguous()
    seq_lens = torch.arange(1, t + 1, dtype=torch.int32, device=query.device)
    out = ops.decode(cache, plan, q, tables, seq_lens, _STATE.backend, variant.two_level)
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    except ImportError:  # older transformers build masks without the registry
        pass


def load_tokens(folder: Path, text_path: Path | None, max_tokens: int, vocab_size: int,
                seed: int) -> tuple[torch.Tensor, str]:
    """Token ids [1, T] of the text (tokenizer in the folder), or seeded random ids when there is no tokenizer."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 - no tokenizer files is the common case for test models
        tok = None
    if tok is not None:
        from kvpolicy.inputs.safeio import MAX_TEXT_BYTES, read_text

        text = read_text(text_path, what="--text", max_bytes=MAX_TEXT_BYTES) if text_path else DEFAULT_TEXT
        ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]
        return ids, f"{ids.shape[1]} tokens of {'`' + str(text_path) + '`' if text_path else 'the built-in text'}"
    if text_path:
        raise InputError(f"--text {text_path}: {folder} has no tokenizer to encode it.")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab_size, (1, max_tokens), generator=gen)
    return ids, f"{max_tokens} random token ids (no tokenizer in {folder})"


def run_model_check(folder: Path, arch: ModelArch, variants: list[Variant], device: torch.device, backend: str,
                    text_path: Path | None = None, max_tokens: int = 512, seed: int = 0) -> tuple[list[ModelCheck], str]:
    """Agreement and KL of each variant's cache against the BF16 cache (BF16 against the model's own attention)."""
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model = AutoModelForCausalLM.from_pretrained(folder, **{kw: dtype})
    model = model.to(device).eval()
    ids, what = load_tokens(folder, text_path, max_tokens, model.config.vocab_size, seed)
    ids = ids.to(device)
    _register()
    stock = model.config._attn_implementation
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits[0].float()
        model.config._attn_implementation = ATTN_NAME
        try:
            logits: dict[str, torch.Tensor] = {}
            for v in variants:
                _STATE.plans, _STATE.variant = plan_layers(arch, v), v
                _STATE.backend, _STATE.device = backend, device
                logits[v.name] = model(ids, use_cache=False).logits[0].float()
        finally:
            model.config._attn_implementation = stock
            _STATE.plans = _STATE.variant = None
    base = logits[variants[0].name]
    checks = [_compare(f"{variants[0].name} (vs the model's own {stock} attention)", reference, base)]
    checks += [_compare(v.name, base, logits[v.name]) for v in variants[1:]]
    return checks, f"{folder.name}: {what}, {dtype} weights, on {device.type}"


def _compare(name: str, base: torch.Tensor, other: torch.Tensor) -> ModelCheck:
    logp, logq = torch.log_softmax(base, -1), torch.log_softmax(other, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = (base.argmax(-1) == other.argmax(-1)).float().mean()
    return ModelCheck(variant=name, tokens=base.shape[0], agreement=round(float(agree), 4),
                      kl_mean=float(f"{float(kl.mean()):.4g}"), kl_max=float(f"{float(kl.max()):.4g}"))
