"""The whole flow for one deployment: inputs -> facts -> rules -> decision -> estimates.

`recommend()` is what the CLI, `kvpolicy check`, the HTTP service and `apply`
call; nothing else assembles a Recommendation.
"""

from __future__ import annotations

import re
from typing import Any

from kvpolicy.arch import ModelArch
from kvpolicy.decision import EvidenceRef, Recommendation, Trace, Workload
from kvpolicy.errors import InputError
from kvpolicy.estimates import estimate
from kvpolicy.facts import build_facts
from kvpolicy.gpus import GpuSpec
from kvpolicy.policy.engine import decide
from kvpolicy.policy.loader import LoadedPolicy
from kvpolicy.policy.schema import resolve_threshold
from kvpolicy.vllm_flags import serve_args

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(text: str | int, what: str = "--context") -> int:
    """`32k` -> 32768, `1.5k` -> 1536, `1m` -> 1048576, `131072` -> 131072."""
    if isinstance(text, bool):
        raise InputError(f"{what}: expected a token count such as 32k or 131072, found {text!r}.")
    if isinstance(text, int):
        value = text
    else:
        m = _TOKENS.match(str(text))
        if not m:
            raise InputError(
                f"{what}: `{text}` is not a token count. Write a whole number (131072) or a number with "
                "k or m (32k = 32,768 tokens, 1m = 1,048,576)."
            )
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
        value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise InputError(f"{what}: must be a positive number of tokens, found {text!r}.")
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


def recommend(arch: ModelArch, gpu: GpuSpec, workload: Workload, loaded: LoadedPolicy) -> Recommendation:
    """Decide the KV cache for one deployment and explain it."""
    # load_policy() already rejected unknown facts, thresholds and dtypes.
    policy = loaded.policy
    facts = build_facts(arch, gpu, workload, policy)
    outcome = decide(policy, facts)
    decision = outcome.decision
    ests = estimate(policy, arch, gpu, workload, decision, outcome.trace["facts"])
    by_id = {e.id: e for e in policy.evidence}
    evidence = [EvidenceRef(id=i, statement=by_id[i].statement, source=by_id[i].source)
                for i in outcome.evidence_ids if i in by_id]
    return Recommendation(
        model=arch.id,
        gpu=gpu.id,
        workload=workload,
        policy=loaded.label,
        decision=decision,
        vllm_args=serve_args(decision, workload),
        estimates=ests,
        warnings=outcome.warnings,
        alternatives=outcome.alternatives,
        evidence=evidence,
        trace=Trace.model_validate(outcome.trace),
    )
