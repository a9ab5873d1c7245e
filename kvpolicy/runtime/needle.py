"""The attention-level needle test: a planted key with a margin over many distractors.

For one layer geometry and one context, every sequence holds `context` random
keys with outlier channels (a few channels with a large spread and offset, as
real keys have) and values with per-channel offsets. One position per
sequence and KV head is replaced by a needle key solved so that every query
head of the group gives it a logit `margin` nats above the log-sum-exp of all
distractors and the sink: in exact arithmetic the needle takes
sigmoid(margin) > 1/2 of the attention. Its value stands out by `NEEDLE_LIFT`
in one channel c*, so the needle's weight can be read back from the output:
p_hat = (o[c*] - mean of distractor values at c*) / (v_needle[c*] - that mean),
the mean taken with the exact weights. A trial is a hit when p_hat > 1/2.

The same data goes through BF16 and every candidate format (store kernel, then
decode kernel); recovery is hits(format) / hits(BF16), the documents' ratio.
MLA latents are K and V at once: the needle channel is then fixed in the key
before the solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvpolicy.errors import InputError
from kvpolicy.facts.kv_memory import layer_kv_bytes_per_token
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.runtime import ops
from kvpolicy.runtime.caches import LayerPlan, allocate, plan_layers, slots_for
from kvpolicy.runtime.variants import Variant

MARGIN_NATS = (0.1, 1.5)
"""Needle margins are drawn uniformly from this range: near the decision line, so logit errors show."""
NEEDLE_LIFT = 8.0
"""How far the needle's value stands out in its channel (in value standard deviations)."""
KEY_OUTLIER_EVERY = 32
"""One key channel in this many is an outlier channel."""
KEY_OUTLIER_STD = 6.0
"""Spread of the outlier channels (the others have 1)."""
KEY_OUTLIER_MEAN = 4.0
"""Offset of the outlier channels."""
STORE_CHUNK_TOKENS = 16384
"""Positions stored per call."""


@dataclass
class NeedleCase:
    """One context's data: exact K/V (fp32), queries, needles, and the exact answer."""

    key: torch.Tensor
    """[batch, context, num_kv_heads, head_dim] fp32."""
    value: torch.Tensor
    """Same shape (the same tensor for MLA latents)."""
    query: torch.Tensor
    """[batch, num_q_heads, head_dim] in the decode dtype."""
    sinks: torch.Tensor | None
    """fp32 [num_q_heads]."""
    channel: torch.Tensor
    """int64 [num_kv_heads]: the needle's value channel per KV head."""
    p_exact: torch.Tensor
    """float64 [batch, num_q_heads]: the needle's exact attention weight."""
    mean_other: torch.Tensor
    """float64 [batch, num_q_heads]: exact weighted mean of the distractor values at the needle channel."""
    needle_value: torch.Tensor
    """float64 [batch, num_q_heads]: the needle's value at its channel."""
    out_exact: torch.Tensor
    """float64 [batch, num_q_heads, out_dim]: exact attention output."""


def geometry_plan(arch: ModelArch) -> LayerPlan:
    """The BF16 plan of the layer the needle test uses: the first full-attention (or MLA) layer."""
    plans = plan_layers(arch, Variant("auto"))
    for kind in ("full", "mla"):
        for p in plans:
            if p.kind == kind:
                return p
    raise InputError(f"{arch.id} has no full-attention or MLA layer: the needle test measures long-context "
                     "attention, which window-bounded layers do not do.")


def geometry_plans(arch: ModelArch) -> list[LayerPlan]:
    """The BF16 plan of the first layer of every distinct attention geometry (full, sliding, MLA; heads, dims,
    window, sinks): a format that fails on one kind of layer fails the model, so each is tested.

    Full (and MLA) layers come first: they carry the long-context retrieval the needle test is about.
    """
    seen: dict[tuple, LayerPlan] = {}
    for p in plan_layers(arch, Variant("auto")):
        if p.kind not in ("full", "mla", "sliding"):
            continue  # linear layers hold no KV; shared layers read another layer's cache
        key = (p.kind, p.num_q_heads, p.num_kv_heads, p.head_dim, p.out_dim, p.window, p.has_sinks, p.sm_scale)
        seen.setdefault(key, p)
    plans = sorted(seen.values(), key=lambda p: (p.kind == "sliding", p.index))
    if not plans or plans[0].kind == "sliding":
        geometry_plan(arch)  # raises the clear error: no full-attention layer
    return plans


def geometry_label(plan: LayerPlan) -> str:
    """`layer 3 (full, 9q/3kv x 64)`: how tables and verdicts name a geometry."""
    win = f", window {plan.window}" if plan.window else ""
    return f"layer {plan.index} ({plan.kind}, {plan.num_q_heads}q/{plan.num_kv_heads}kv x {plan.head_dim}{win})"


def plan_for(arch: ModelArch, base: LayerPlan, variant: Variant) -> LayerPlan | None:
    """The geometry layer in the variant's format (None where the format does not apply: TurboQuant or the
    per-token-head formats on MLA)."""
    fmt = FORMATS[variant.kv_cache_dtype]
    if base.kind == "sliding" and "sliding_window" in variant.skip_layers:
        fmt = FORMATS["auto"]  # the variant keeps these layers BF16
    if base.kind == "mla" and (fmt.kind == "turboquant" or fmt.per_token_head):
        return None
    return replace(base, fmt=fmt, bytes_per_token=layer_kv_bytes_per_token(arch, base.index, fmt))


def make_case(plan: LayerPlan, batch: int, context: int, device: torch.device, dtype: torch.dtype,
              seed: int) -> NeedleCase:
    """Draw one context's keys, values, queries and needles, and the exact answer."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hkv, d, hq = plan.num_kv_heads, plan.head_dim, plan.num_q_heads
    group = hq // hkv
    shared_kv = plan.kind == "mla"

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device)

    outlier = torch.zeros(d, dtype=torch.bool)
    outlier[torch.randperm(d, generator=gen)[: max(1, d // KEY_OUTLIER_EVERY)]] = True
    std = torch.where(outlier, KEY_OUTLIER_STD, 1.0).to(device)
    mean = torch.where(outlier, KEY_OUTLIER_MEAN, 0.0).to(device)
    key = randn(batch, context, hkv, d) * std + mean
    if shared_kv:
        value = key
    else:
        value = randn(batch, context, hkv, d) + randn(hkv, d)  # per-channel offsets
    query = randn(batch, hq, d).to(dtype)
    sinks = randn(hq) if plan.has_sinks else None
    # The needle channel: not an outlier, and inside the output for MLA.
    normal = torch.nonzero(~outlier[: plan.out_dim]).flatten()
    channel = normal[torch.randint(len(normal), (hkv,), generator=gen)].to(device)
    position = torch.randint(context, (batch,), generator=gen).to(device)
    margin = torch.empty(batch, hq, dtype=torch.float64).uniform_(*MARGIN_NATS, generator=gen).to(device)

    q64 = query.to(torch.float64)  # the decode dtype's rounding is part of the exact problem
    scale = plan.sm_scale
    for b in range(batch):
        pos = int(position[b])
        k64 = key[b].to(torch.float64)
        logits = _logits(q64[b], k64, group) * scale
        logits[:, pos] = -math.inf
        terms = [logits]
        if sinks is not None:
            terms.append(sinks.to(torch.float64)[:, None])
        lse = torch.logsumexp(torch.cat(terms, dim=1), dim=1)
        target = (lse + margin[b]) / scale  # wanted q . k_needle per query head
        for g in range(hkv):
            q_g = q64[b, g * group:(g + 1) * group]
            k = k64[pos, g].clone()
            c = int(channel[g])
            lift = float(value[b, :, g, c].mean()) + NEEDLE_LIFT
            free = torch.ones(d, dtype=torch.bool, device=device)
            if shared_kv:
                k[c] = lift
                free[c] = False
            a = q_g[:, free]
            residual = target[g * group:(g + 1) * group] - q_g @ k
            k[free] += a.T @ torch.linalg.solve(a @ a.T, residual)
            key[b, pos, g] = k.to(torch.float32)
            if not shared_kv:
                value[b, pos, g, c] = lift
    out, p, m, vn = _exact(plan, key, value, query, sinks, channel, position)
    return NeedleCase(key, value, query, sinks, channel, p, m, vn, out)


def _exact(plan: LayerPlan, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, sinks: torch.Tensor | None,
           channel: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float64 attention over the fp32 data: output, needle weight, distractor mean and needle value at c*."""
    batch, _, hkv, _ = key.shape
    hq = query.shape[1]
    group = hq // hkv
    heads_channel = channel.repeat_interleave(group)
    outs, ps, means, vns = [], [], [], []
    heads = torch.arange(hq, device=key.device)
    for b in range(batch):
        k = key[b].to(torch.float64)
        v = value[b].to(torch.float64)
        logits = _logits(query[b].to(torch.float64), k, group) * plan.sm_scale
        if sinks is not None:
            logits = torch.cat([logits, sinks.to(torch.float64)[:, None]], dim=1)
        probs = torch.softmax(logits, dim=1)[:, : k.shape[0]]
        out = torch.einsum("gjl,lgd->gjd", probs.view(hkv, group, -1), v).reshape(hq, -1)
        outs.append(out[:, : plan.out_dim])
        pos = int(position[b])
        vc = v[:, heads // group, heads_channel]  # [L, hq]: the value at each head's needle channel
        p = probs[:, pos]
        other = probs.clone()
        other[:, pos] = 0.0
        means.append((other * vc.T).sum(1) / other.sum(1))
        ps.append(p)
        vns.append(vc[pos])
    return torch.stack(outs), torch.stack(ps), torch.stack(means), torch.stack(vns)


def _logits(query: torch.Tensor, key: torch.Tensor, group: int) -> torch.Tensor:
    """q . k for query [hq, d] and key [L, hkv, d] without repeating K per query head: [hq, L]."""
    hkv = key.shape[1]
    return torch.einsum("gjd,lgd->gjl", query.view(hkv, group, -1), key).reshape(hkv * group, -1)


@dataclass
class NeedleScore:
    """One format at one context."""

    hits: int
    """Trials whose recovered needle weight exceeds 1/2."""
    trials: int
    """Trials (sequences x query heads)."""
    p_abs_error: float
    """Mean |p_hat - p_exact|."""
    out_rel_error: float
    """||out - exact|| / ||exact|| over the whole output."""
    hit_mask: torch.Tensor | None = None
    """bool [batch, num_q_heads]: which trials hit (pairs a format's hits with BF16's)."""


def _calibrated_scales(case: NeedleCase, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 scales from the amax of every stored token (needles included): the best a calibration can do.

    A sample that misses the needle would clip it at 448 x scale, which tests the sample, not the format.
    """
    from kvpolicy.kernels.paged_store import compute_kv_scales

    context = case.key.shape[1]
    amax_k = amax_v = None
    for lo in range(0, context, STORE_CHUNK_TOKENS):
        k = case.key[:, lo:lo + STORE_CHUNK_TOKENS].abs().amax(dim=(0, 1, 3))
        v = case.value[:, lo:lo + STORE_CHUNK_TOKENS].abs().amax(dim=(0, 1, 3))
        amax_k = k if amax_k is None else torch.maximum(amax_k, k)
        amax_v = v if amax_v is None else torch.maximum(amax_v, v)
    assert amax_k is not None and amax_v is not None
    return compute_kv_scales(amax_k[None, :, None], amax_v[None, :, None], per_head)


def score(plan: LayerPlan, variant: Variant, case: NeedleCase, device: torch.device, backend: str) -> NeedleScore:
    """Store the case in the variant's format (`plan` from `plan_for`), decode, and score the needle."""
    if plan.fmt is None or plan.fmt.kind != variant.kind:
        raise ValueError(f"plan of layer {plan.index} holds {plan.fmt and plan.fmt.name}, not {variant.name}: "
                         "use plan_for(arch, geometry, variant)")
    batch, context, hkv, d = case.key.shape
    cache = allocate([plan], batch, context, device, layout=variant.cache_layout)[0]
    assert cache is not None
    cache.sinks = case.sinks
    if variant.kind == "fp8" and variant.scale_source != "uncalibrated":
        cache.k_scale, cache.v_scale = _calibrated_scales(case, variant.scale_source != "checkpoint_per_tensor")
    for lo in range(0, context, STORE_CHUNK_TOKENS):
        hi = min(lo + STORE_CHUNK_TOKENS, context)
        slots = slots_for(torch.arange(lo, hi, device=device), cache.block_tables).reshape(-1)
        k = case.key[:, lo:hi].reshape(-1, hkv, d).contiguous()
        v = case.value[:, lo:hi].reshape(-1, hkv, d).contiguous()
        ops.store(cache, k, v, slots, backend)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    # One-level accumulation is decoded unsplit: the MMA then carries each sequence's whole context, as when a
    # serving batch's sequences and KV heads fill the GPU without split-KV (its worst case; splits would reset it).
    out = ops.decode(cache, plan, case.query, cache.block_tables, seq_lens, backend, variant.two_level,
                     num_splits=None if variant.two_level else 1)
    out = out.to(torch.float64)
    group = plan.num_q_heads // hkv
    ch = case.channel.repeat_interleave(group)
    o_c = out[:, torch.arange(plan.num_q_heads, device=out.device), ch]
    p_hat = (o_c - case.mean_other) / (case.needle_value - case.mean_other)
    hits = int((p_hat > 0.5).sum())
    err = float((p_hat - case.p_exact).abs().mean())
    rel = float((out - case.out_exact).norm() / case.out_exact.norm())
    del cache
    return NeedleScore(hits, p_hat.numel(), err, rel, (p_hat > 0.5).cpu())
