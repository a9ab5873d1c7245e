"""KV variants the runtime measures: a Decision, or a name given with `--compare`.

A variant is what one set of per-layer caches holds: a KV dtype, the layers
kept BF16, and the two kernel switches a Decision carries (two-level
accumulation, scale source). Its `key` is the name ITL evidence uses
(`bf16`, `fp8`, `fp8_skip_sliding`, `turboquant_*`), shared with the estimates
through `variant_key`. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpolicy.errors import InputError
from kvpolicy.facts.estimates import variant_key
from kvpolicy.formats import FORMATS
from kvpolicy.rules.decision import Decision

SCALE_MODIFIERS = {"uncalibrated": "uncalibrated", "per_tensor": "checkpoint_per_tensor",
                   "per_head": "checkpoint_per_head"}
"""`+modifier` -> Decision.scale_source."""

BASE_NAMES = {"bf16": ("auto", ()), "auto": ("auto", ()), "bfloat16": ("auto", ()),
              "fp8": ("fp8", ()), "fp8_e4m3": ("fp8", ()), "fp8_skip_sliding": ("fp8", ("sliding_window",))}
"""Variant names beside the TurboQuant dtypes, as (kv_cache_dtype, skip_layers)."""


@dataclass(frozen=True)
class Variant:
    """One KV configuration to allocate and run."""

    kv_cache_dtype: str
    """vLLM `--kv-cache-dtype` (`auto` = BF16)."""
    skip_layers: tuple[str, ...] = ()
    """Layers kept BF16: `sliding_window` or indices."""
    two_level: bool = True
    """FP8 P.V accumulated tile by tile in fp32 (the kernel's `two_level` switch)."""
    scale_source: str = "uncalibrated"
    """FP8 scales: uncalibrated (1.0), checkpoint_per_tensor or checkpoint_per_head (computed from the data)."""
    cache_layout: str = "NHD"
    """Page order of BF16/FP8 caches, as vLLM's backend keeps them: NHD, or HND (one KV head's page contiguous)."""

    @property
    def key(self) -> str:
        """Name in ITL evidence: bf16, fp8, fp8_skip_sliding, turboquant_*."""
        return variant_key(self.kv_cache_dtype, list(self.skip_layers))

    @property
    def is_plain(self) -> bool:
        """Default switches (two-level on, uncalibrated): what the evidence keys describe."""
        return self.two_level and self.scale_source == "uncalibrated"

    @property
    def name(self) -> str:
        """Display name: the evidence key plus the switches that differ from the default."""
        mods = []
        if self.kind == "fp8" and not self.two_level:
            mods.append("one_level")
        if self.kind == "fp8" and self.scale_source != "uncalibrated":
            mods.append({v: k for k, v in SCALE_MODIFIERS.items()}.get(self.scale_source, "per_head"))
        return "+".join([self.key, *mods])

    @property
    def kind(self) -> str:
        """Format family: bf16, fp8, turboquant or *_per_token_head."""
        return FORMATS[self.kv_cache_dtype].kind

    @classmethod
    def of_decision(cls, decision: Decision) -> Variant:
        """The variant a Decision selects."""
        dtype = decision.kv_cache_dtype
        _check_dtype(dtype, "the decision")
        kind = FORMATS[dtype].kind
        return cls(
            kv_cache_dtype="auto" if kind == "bf16" else dtype,
            skip_layers=tuple(decision.skip_layers) if kind != "bf16" else (),
            two_level=decision.two_level_accumulation != "off",
            scale_source=decision.scale_source if kind == "fp8" else "uncalibrated",
        )


RUNTIME_FAMILIES = ("bf16", "fp8", "turboquant", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")
"""The format families kvpolicy's kernels store and decode (on Hopper and off it)."""


def _check_dtype(dtype: str, where: str) -> None:
    fmt = FORMATS.get(dtype)
    if fmt is None:
        raise InputError(f"{where}: unknown KV dtype `{dtype}`; known: {', '.join(FORMATS)}.")
    if fmt.kind == "nvfp4":
        # vLLM serves nvfp4 through FlashInfer (nvfp4_4over6 on SM100 only); no kernel of ours decodes it.
        raise InputError(f"{where}: `{dtype}` cannot run on Hopper in kvpolicy's runtime: its kernels have no FP4 "
                         "path (NVFP4 is decoded natively by Blackwell's FP4 tensor cores; vLLM serves it with "
                         "FlashInfer). Its capacity and accuracy come from the policy's evidence "
                         "(`kvpolicy rule KV111`), not from a measurement here; compare fp8 or int4_per_token_head.")
    if fmt.kind not in RUNTIME_FAMILIES:
        raise InputError(f"{where}: `{dtype}` ({fmt.kind}) is not run by kvpolicy's kernels; they run "
                         "bf16, fp8, the TurboQuant formats and the *_per_token_head formats.")
    if fmt.kind == "fp8" and fmt.fp8_variant != "e4m3":
        raise InputError(f"{where}: `{dtype}` is not run by kvpolicy's kernels (they store FP8 as e4m3); "
                         "compare `fp8` instead.")
    if dtype == "float16":
        raise InputError(f"{where}: float16 caches are not run by kvpolicy's kernels; compare `bf16`.")


def parse_variant(text: str, default_two_level: bool = True) -> Variant:
    """`fp8`, `fp8_skip_sliding`, `turboquant_4bit_nc`, `bf16`, with `+one_level`, `+per_tensor`, `+per_head`."""
    base, *mods = [p.strip() for p in text.strip().split("+")]
    if base in BASE_NAMES:
        dtype, skip = BASE_NAMES[base]
    elif base in FORMATS and (FORMATS[base].kind == "turboquant" or FORMATS[base].per_token_head
                              or FORMATS[base].kind == "nvfp4"):
        dtype, skip = base, ()
    else:
        from kvpolicy.errors import did_you_mean

        known = [*BASE_NAMES, *(n for n, f in FORMATS.items() if f.kind == "turboquant" or f.per_token_head)]
        raise InputError(f"--compare: unknown variant `{base}`.{did_you_mean(base, known)} "
                         f"Known: {', '.join(known)}; modifiers: +one_level, +two_level, "
                         f"{', '.join('+' + m for m in SCALE_MODIFIERS)}.")
    _check_dtype(dtype, "--compare")
    two_level, scales = default_two_level, "uncalibrated"
    for mod in mods:
        if mod == "one_level":
            two_level = False
        elif mod == "two_level":
            two_level = True
        elif mod in SCALE_MODIFIERS:
            scales = SCALE_MODIFIERS[mod]
        else:
            raise InputError(f"--compare: unknown modifier `+{mod}` in `{text}`; use +one_level, +two_level, "
                             f"{', '.join('+' + m for m in SCALE_MODIFIERS)}.")
    if FORMATS[dtype].kind != "fp8" and mods:
        raise InputError(f"--compare `{text}`: modifiers apply to FP8 variants only.")
    return Variant(dtype, tuple(skip), two_level, scales)


def cache_layout(decision: Decision, generation: str) -> str:
    """The page order vLLM gives BF16/FP8 caches under the decision's attention backend.

    vLLM's FlashInfer backend requires head-major pages (HND) on Blackwell, for its TRT-LLM
    kernels; the other backends kvpolicy selects (FLASH_ATTN, TRITON_ATTN) keep vLLM's default
    NHD. The layout changes what the kernels read per page (bench/KERNELS.md: FP8 on a head_dim
    64 layer reads 23% faster from HND pages), so the runtime measures the one vLLM would use.
    """
    return "HND" if decision.attention_backend == "FLASHINFER" and generation == "blackwell" else "NHD"


def variant_list(decision: Decision, compare: list[str], layout: str = "NHD") -> list[Variant]:
    """BF16 first, then the decision's variant, then `--compare` ones, all on `layout`; duplicates dropped."""
    chosen = Variant.of_decision(decision)
    out: list[Variant] = []
    for v in [Variant("auto"), chosen, *(parse_variant(c, chosen.two_level) for c in compare if c.strip())]:
        v = replace(v, cache_layout=layout)
        if v not in out:
            out.append(v)
    return out
