"""The workload a deployment asks of the GPU, from the command line, a deployment or a request."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpolicy.errors import InputError
from kvpolicy.inputs.policy_schema import resolve_threshold

if TYPE_CHECKING:
    from kvpolicy.inputs.policy_loader import LoadedPolicy

Priority = Literal["decode", "prefill", "balanced"]
MAX_TOKENS = 16_777_216
"""Longest context accepted anywhere (16M tokens; the Workload's bound)."""


class Workload(BaseModel):
    """What the deployment asks of the GPU."""

    model_config = ConfigDict(defer_build=True, extra="forbid", allow_inf_nan=False)

    context_tokens: int = Field(default=32768, gt=0, le=MAX_TOKENS)
    """Context length per request (prompt plus output), in tokens."""
    priority: Priority = "decode"
    """What latency matters most: decode (ITL), prefill (TTFT) or both."""
    concurrency: int = Field(default=1, gt=0, le=1_000_000)
    """Requests served at once at that context."""
    tp: int = Field(default=1, gt=0, le=1024)
    """Tensor-parallel size (GPUs per replica)."""
    accuracy_floor: float = Field(default=0.95, gt=0, le=1)
    """Lowest acceptable accuracy recovery vs BF16 (0-1)."""
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    """Fraction of GPU memory vLLM may use (vLLM's default 0.92)."""


_TOKENS = re.compile(r"^\s*([0-9]{1,12}(?:\.[0-9]{1,12})?)\s*([kKmM]?)\s*$")
"""ASCII digits only (a Unicode digit class would also take full-width and other scripts' digits)."""


def parse_tokens(text: str | int, what: str = "--context") -> int:
    """`32k` -> 32768, `1.5k` -> 1536, `1m` -> 1048576, `131072` -> 131072."""
    if isinstance(text, bool):
        raise InputError(f"{what}: expected a token count such as 32k or 131072, found {text!r}.")
    if isinstance(text, int):
        value = text
    elif not isinstance(text, str) or len(text) > 40:
        raise InputError(f"{what}: expected a token count such as 32k or 131072, found {str(text)[:40]!r}.")
    else:
        m = _TOKENS.match(text)
        if not m:
            raise InputError(
                f"{what}: `{text}` is not a token count. Write a whole number (131072) or a number with "
                "k or m (32k = 32,768 tokens, 1m = 1,048,576)."
            )
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
        value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise InputError(f"{what}: must be a positive number of tokens, found {text!r}.")
    if value > MAX_TOKENS:
        raise InputError(f"{what}: {str(text)[:40]} is more than {MAX_TOKENS:,} tokens (16m), the most accepted; "
                         "use a context in 1..16m.")
    return value


def make_workload(loaded: LoadedPolicy, *, context: str | int = 32768, priority: str = "decode",
                  concurrency: int = 1, tp: int = 1, accuracy_floor: float | None = None,
                  gpu_memory_utilization: float = 0.92) -> Workload:
    """Validate workload inputs; the accuracy floor defaults to the policy's and respects its constraint."""
    from pydantic import ValidationError

    policy = loaded.policy
    floor = accuracy_floor if accuracy_floor is not None else resolve_threshold(policy, "accuracy_floor", {})
    minimum = policy.constraints.min_accuracy_floor
    if minimum is not None and floor is not None and floor < minimum:
        raise InputError(
            f"--accuracy-floor {floor:g} is below the policy's constraint min_accuracy_floor {minimum:g} "
            f"({loaded.chain[0]}). Use a floor of at least {minimum:g}."
        )
    try:
        return Workload(
            context_tokens=parse_tokens(context),
            priority=priority,  # type: ignore[arg-type]
            concurrency=concurrency,
            tp=tp,
            accuracy_floor=floor if floor is not None else 0.95,
            gpu_memory_utilization=gpu_memory_utilization,
        )
    except ValidationError as exc:
        raise InputError(_workload_error(exc)) from None


_FLAG = {"context_tokens": "--context", "priority": "--priority", "concurrency": "--concurrency", "tp": "--tp",
         "accuracy_floor": "--accuracy-floor", "gpu_memory_utilization": "--gpu-memory-utilization"}


def _workload_error(exc: Any) -> str:
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err.get("loc") else "?"
        parts.append(f"{_FLAG.get(name, name)} {err['input']!r}: {err['msg'].lower()}.")
    return " ".join(parts) + " Fix the value and run again (see `kvpolicy recommend --help`)."
