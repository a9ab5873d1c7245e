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

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvpolicy.errors import InputError
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.runtime import ops
from kvpolicy.runtime.caches import LayerPlan, allocate, plan_layers, slots_for
from kvpolicy.runtime.confidence import wilson
from kvpolicy.runtime.variants import Variant
from kvpolicy.runtime.verify import ModelCheck, RetrievalPoint

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
"""Text used when no --text file is given and CPython's `pydoc_data` is missing."""
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
QUERY_CHUNK = 256
"""Query rows per float64 attention block on the CPU path (bounds its memory at long texts)."""


def has_weights(path: Path) -> bool:
    """True when `path` is a folder holding model weights, or a .gguf file (transformers + gguf dequantize it)."""
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and any(next(path.glob(p), None) for p in (*WEIGHT_PATTERNS, "*.gguf"))


def model_source(path: Path) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) that transformers loads the model from."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.parent, path.name
    if path.is_file():
        path = path.parent
    if not any(next(path.glob(p), None) for p in WEIGHT_PATTERNS):
        from kvpolicy.inputs.gguf import gguf_in

        found = gguf_in(path)
        if found is not None:
            return path, found.name
    return path, None


def builtin_text() -> tuple[str, str]:
    """Real English prose that ships with Python: the help topics of `pydoc_data` (DEFAULT_TEXT without it)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return DEFAULT_TEXT, "the built-in text"
    return "\n\n".join(topics[k] for k in sorted(topics)), "CPython's pydoc_data help topics"


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
    if _STATE.backend == "reference":
        return causal_reference(cache, plan, q).to(query.dtype).unsqueeze(0), None
    tables = cache.block_tables.expand(t, -1).contiguous()
    seq_lens = torch.arange(1, t + 1, dtype=torch.int32, device=query.device)
    out = ops.decode(cache, plan, q, tables, seq_lens, _STATE.backend, variant.two_level)
    return out.unsqueeze(0), None


def causal_reference(cache: Any, plan: LayerPlan, query: torch.Tensor) -> torch.Tensor:
    """Float64 causal attention over one sequence's stored cache: [T, Hq, D] for query [T, Hq, D].

    The same numbers as T reference decodes of lengths 1..T (the stored tokens dequantize the same
    whatever the length), with the cache dequantized once: T times less work on the CPU.
    """
    fmt = plan.fmt
    assert fmt is not None
    t, hq, d = query.shape
    if fmt.kind == "turboquant":
        from kvpolicy.kernels.tq_reference import dequantize_slots_ref, gather_cache_ref, slots_from_planar

        packed = cache.key_cache if cache.key_cache.dim() != 3 else slots_from_planar(cache.key_cache, fmt.name, d)
        k, v = dequantize_slots_ref(gather_cache_ref(packed, cache.block_tables, t, 0), fmt.name, d)
    else:
        from kvpolicy.kernels.reference import dequantize_tokens

        k = dequantize_tokens(cache.key_cache, cache.block_tables[0], t, cache.k_scale)
        v = dequantize_tokens(cache.value_cache, cache.block_tables[0], t, cache.v_scale)
    k, v = k.to(torch.float64), v.to(torch.float64)
    hkv = k.shape[1]
    group = hq // hkv
    pos = torch.arange(t, device=query.device)
    out = torch.empty(t, hq, d, dtype=torch.float64, device=query.device)
    for lo in range(0, t, QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, t)
        q = query[lo:hi].to(torch.float64).view(hi - lo, hkv, group, d)
        logits = torch.einsum("tkgd,nkd->kgtn", q, k[:hi]) * plan.sm_scale  # [hkv, group, rows, hi]
        rows = pos[lo:hi, None]
        masked = pos[None, :hi] > rows
        if plan.window:
            masked |= pos[None, :hi] <= rows - plan.window
        logits = logits.masked_fill(masked, -math.inf)
        if cache.sinks is not None:
            sink = cache.sinks.to(torch.float64).view(hkv, group, 1, 1).expand(hkv, group, hi - lo, 1)
            logits = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :hi]
        out[lo:hi] = torch.einsum("kgtn,nkd->tkgd", probs, v[:hi]).reshape(hi - lo, hq, d)
    return out


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    except ImportError:  # older transformers build masks without the registry
        pass


def load_tokenizer(folder: Path, gguf_file: str | None = None) -> Any:
    """The tokenizer in the folder or the GGUF file (None without one)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception:  # noqa: BLE001 - no tokenizer files is the common case for test models
        return None


def load_tokens(folder: Path, text_path: Path | None, max_tokens: int, vocab_size: int,
                seed: int, gguf_file: str | None = None, tok: Any = None) -> tuple[torch.Tensor, str]:
    """Token ids [1, T] of the text (tokenizer in the folder or the GGUF file), or seeded random ids without one."""
    if tok is None:
        tok = load_tokenizer(folder, gguf_file)
    if tok is not None:
        if text_path:
            from kvpolicy.inputs.safeio import MAX_TEXT_BYTES, read_text

            text, name = read_text(text_path, what="--text", max_bytes=MAX_TEXT_BYTES), f"`{text_path}`"
        else:
            text, name = builtin_text()
        ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]
        if ids.shape[1] < 2:
            raise InputError(f"--text {text_path}: it encodes to {ids.shape[1]} token(s); the check needs at least 2.")
        return ids, f"{ids.shape[1]} tokens of {name}"
    if text_path:
        raise InputError(f"--text {text_path}: {folder} has no tokenizer to encode it.")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab_size, (1, max_tokens), generator=gen)
    return ids, f"{max_tokens} random token ids (no tokenizer in {folder})"


def load_model(path: Path, device: torch.device) -> tuple[Any, str | None]:
    """The transformers model of a folder or .gguf file (GGUF weights dequantized by transformers + gguf)."""
    import transformers
    from transformers import AutoModelForCausalLM

    folder, gguf_file = model_source(path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw: dict[str, Any] = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}  # renamed in 4.56
    if gguf_file:
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise InputError(f"{path}: reading GGUF weights needs the `gguf` package (pip install gguf "
                             "accelerate).") from None
        kw["gguf_file"] = gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kw)
    except (ValueError, OSError, ImportError) as exc:
        raise InputError(f"{path}: transformers cannot load this model ({str(exc).splitlines()[0]}).") from None
    return model.to(device).eval(), gguf_file


def _forward(model: Any, ids: torch.Tensor, arch: ModelArch, v: Variant, backend: str, device: torch.device,
             keep: int = 0) -> torch.Tensor:
    """Next-token logits [T, vocab] (the last `keep` positions only when keep > 0) with `v`'s cache."""
    _STATE.plans, _STATE.variant = plan_layers(arch, v), v
    _STATE.backend, _STATE.device = backend, device
    if keep:
        try:  # the vocabulary projection of every position would dwarf the rest at long prompts
            return model(ids, use_cache=False, logits_to_keep=keep).logits[0].float()
        except TypeError:  # a model class without logits_to_keep
            return model(ids, use_cache=False).logits[0, -keep:].float()
    return model(ids, use_cache=False).logits[0].float()


def run_model_check(folder: Path, arch: ModelArch, variants: list[Variant], device: torch.device, backend: str,
                    text_path: Path | None = None, max_tokens: int = 512, seed: int = 0,
                    on_step: Callable[[str], None] | None = None, retrieval_contexts: list[int] | None = None,
                    retrieval_trials: int = 0) -> tuple[list[ModelCheck], str, list[RetrievalPoint], str]:
    """Agreement, KL and perplexity of each variant's cache against the BF16 cache (BF16 against the model's
    own attention); on a GPU the same through the float64 references beside the kernels' figures; then the
    retrieval test at `retrieval_contexts` when `retrieval_trials` > 0. `on_step` is called after loading and
    after each forward pass (or each variant's retrieval prompts at one context)."""
    model, gguf_file = load_model(folder, device)
    src, _ = model_source(folder)
    tok = load_tokenizer(src, gguf_file)
    ids, what = load_tokens(src, text_path, max_tokens, model.config.vocab_size, seed, gguf_file, tok)
    ids = ids.to(device)
    if on_step:
        on_step(f"loaded {folder.name}")
    _register()
    stock = model.config._attn_implementation
    backends = [backend] + (["reference"] if backend != "reference" else [])
    points: list[RetrievalPoint] = []
    retrieval_note = ""
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits[0].float()
        if on_step:
            on_step(f"model's own {stock} attention")
        model.config._attn_implementation = ATTN_NAME
        try:
            logits: dict[tuple[str, str], torch.Tensor] = {}
            for b in backends:
                for v in variants:
                    logits[(b, v.name)] = _forward(model, ids, arch, v, b, device)
                    if on_step:
                        on_step(v.name if b == backend else f"{v.name} (float64 reference)")
            if retrieval_trials > 0:
                points, retrieval_note = _retrieval(model, tok, arch, variants, device, backend,
                                                    retrieval_contexts or [], retrieval_trials, seed, on_step)
        finally:
            model.config._attn_implementation = stock
            _STATE.plans = _STATE.variant = None
    targets = ids[0, 1:]
    first = variants[0].name
    checks = [_compare(f"{first} (vs the model's own {stock} attention)", reference, logits[(backend, first)],
                       targets)]
    checks += [_compare(v.name, logits[(backend, first)], logits[(backend, v.name)], targets) for v in variants[1:]]
    if len(backends) > 1:
        ref = [_compare("", reference, logits[("reference", first)])]
        ref += [_compare("", logits[("reference", first)], logits[("reference", v.name)]) for v in variants[1:]]
        for c, r in zip(checks, ref):
            c.reference_agreement, c.reference_kl_mean = r.agreement, r.kl_mean
            c.kernel_kl_ratio = round(c.kl_mean / r.kl_mean, 3) if r.kl_mean > 0 else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    note = (f"{folder.name}: {what}, {dtype} weights" + (" (dequantized from GGUF)" if gguf_file else "")
            + f", on {device.type}" + (" through the kernels and through the float64 references"
                                       if len(backends) > 1 else ""))
    return checks, note, points, retrieval_note


RETRIEVAL_FACT = "\n\nThe secret passcode is{answer}. Remember this passcode.\n\n"
RETRIEVAL_QUESTION = "\n\nQuestion: what is the secret passcode given in the text above?\nAnswer: The secret passcode is"
RETRIEVAL_MAX_TOKENS = 32768
"""Longest retrieval prompt: each one is a full causal pass, T queries over up to T stored tokens per layer."""


def retrieval_prompts(tok: Any, filler: list[int], context: int, trials: int, seed: int) -> list[tuple[list[int], int]]:
    """(token ids, answer length) of `trials` prompts of `context` tokens: filler text with a six-digit passcode
    planted at depths spread evenly over the prompt, and the question at the end followed by the answer."""
    import random

    rng = random.Random(seed * 1_000_003 + context)
    prefix = tok("", add_special_tokens=True).input_ids  # BOS where the tokenizer adds one
    question = tok(RETRIEVAL_QUESTION, add_special_tokens=False).input_ids
    out = []
    for i in range(trials):
        answer_text = f" {rng.randrange(100_000, 1_000_000)}"
        fact = tok(RETRIEVAL_FACT.format(answer=answer_text), add_special_tokens=False).input_ids
        answer = tok(answer_text, add_special_tokens=False).input_ids
        budget = context - len(prefix) - len(fact) - len(question) - len(answer)
        if budget < 16:
            raise InputError(f"a retrieval prompt of {context} tokens has no room for filler text; use longer contexts.")
        depth = (i + 0.5) / trials
        before = int(budget * depth)
        start = rng.randrange(len(filler))
        text = [filler[(start + j) % len(filler)] for j in range(budget)]
        out.append((prefix + text[:before] + fact + text[before:] + question + answer, len(answer)))
    return out


def _retrieval(model: Any, tok: Any, arch: ModelArch, variants: list[Variant], device: torch.device, backend: str,
               contexts: list[int], trials: int, seed: int,
               on_step: Callable[[str], None] | None) -> tuple[list[RetrievalPoint], str]:
    if tok is None:
        return [], "skipped: the model has no tokenizer to write the prompts with"
    limit = min(RETRIEVAL_MAX_TOKENS, int(getattr(model.config, "max_position_embeddings", 0) or RETRIEVAL_MAX_TOKENS))
    run_at = [c for c in contexts if c <= limit]
    skipped = [c for c in contexts if c > limit]
    if not run_at:
        return [], f"skipped: every context is above {limit:,} tokens (the model's limit or the pass's cost)"
    text, source = builtin_text()
    filler = tok(text, add_special_tokens=False).input_ids
    points: list[RetrievalPoint] = []
    for c in run_at:
        prompts = retrieval_prompts(tok, filler, c, trials, seed)
        hit: dict[str, list[bool]] = {}
        for v in variants:
            hit[v.name] = []
            for ids, n in prompts:
                x = torch.tensor([ids], device=device)
                lg = _forward(model, x, arch, v, backend, device, keep=n + 1)
                guess = lg[:-1].argmax(-1)
                hit[v.name].append(bool((guess == x[0, -n:]).all()))
            if on_step:
                on_step(f"retrieval {v.name} at {c:,}")
        base = hit[variants[0].name]
        for v in variants:
            hits = hit[v.name]
            p = RetrievalPoint(variant=v.name, context_tokens=c, trials=len(hits), hits=sum(hits))
            if v is not variants[0]:
                kept, n_base = sum(a and b for a, b in zip(base, hits)), sum(base)
                p.kept, p.bf16_hits = kept, n_base
                if n_base:
                    lo, hi = wilson(kept, n_base)
                    p.recovery, p.recovery_low, p.recovery_high = round(kept / n_base, 4), round(lo, 4), round(hi, 4)
            points.append(p)
    note = (f"{trials} prompts per context: filler from {source}, a six-digit "
            "passcode planted at depths spread evenly from start to end, the question at the end; a hit when every "
            "answer token is the top-1 next token (teacher forced); recovery = the BF16 hits the format keeps, with "
            "its 95% Wilson interval")
    if skipped:
        note += f"; not run at {', '.join(f'{c:,}' for c in skipped)} (above {limit:,} tokens)"
    return points, note


def _perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean next-token NLL) of the text (position i predicts token i + 1)."""
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), targets, reduction="mean")
    return float(torch.exp(nll))


def _compare(name: str, base: torch.Tensor, other: torch.Tensor, targets: torch.Tensor | None = None) -> ModelCheck:
    logp, logq = torch.log_softmax(base.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)
    same = int((base.argmax(-1) == other.argmax(-1)).sum())
    n = base.shape[0]
    lo, hi = wilson(same, n)
    ppl_delta = None
    if targets is not None and targets.numel():
        ppl_delta = _perplexity(other, targets) / _perplexity(base, targets) - 1.0
    return ModelCheck(variant=name, tokens=n, agreement=round(same / n, 4), agreement_low=round(lo, 4),
                      agreement_high=round(hi, 4), kl_mean=float(f"{float(kl.mean()):.4g}"),
                      kl_max=float(f"{float(kl.max()):.4g}"),
                      kl_p99=float(f"{float(torch.quantile(kl, 0.99)):.4g}"),
                      ppl_delta=None if ppl_delta is None else float(f"{ppl_delta:.4g}"))
