"""A policy's `deployments:` turned into inputs and recommendations (for check, diff, explain, test).

Errors name the deployment and the line it is written on, e.g.
``team.yaml:41:5: deployment `chat`: --model: unknown model `lama3`...``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvpolicy import noun
from kvpolicy.errors import InputError, KvPolicyError, did_you_mean
from kvpolicy.inputs.policy_loader import BUILTIN, LoadedPolicy
from kvpolicy.inputs.policy_schema import Deployment
from kvpolicy.inputs.policy_sources import Sources

if TYPE_CHECKING:
    from kvpolicy.inputs.arch import ModelArch
    from kvpolicy.inputs.gpus import GpuSpec
    from kvpolicy.inputs.workload import Workload
    from kvpolicy.rules.decision import Recommendation


def find_deployment(loaded: LoadedPolicy, name: str) -> Deployment:
    """The deployment called `name`, or an InputError listing the others."""
    for dep in loaded.policy.deployments:
        if dep.name == name:
            return dep
    names = [d.name for d in loaded.policy.deployments]
    listed = ", ".join(names) if names else "none: add a `deployments:` list"
    raise InputError(f"no deployment `{name}` in {loaded.chain[0]}.{did_you_mean(name, names)} "
                     f"Deployments: {listed}.")


def _where(loaded: LoadedPolicy, dep: Deployment) -> str:
    file, line, col = Sources.of(loaded).deployment(dep.name)
    at = f"{file}:{line}:{col}" if line is not None else file
    return f"{at}: deployment `{dep.name}`"


def _model_spec(loaded: LoadedPolicy, spec: str) -> str:
    """Local model paths in a policy are relative to the policy file's folder."""
    looks_like_path = spec.startswith(("./", "../")) or spec.endswith(".json")
    top = loaded.chain[0]
    if looks_like_path and not top.startswith(BUILTIN) and not Path(spec).is_absolute():
        return str(Path(top).parent / spec)
    return spec


def deployment_inputs(loaded: LoadedPolicy, dep: Deployment) -> tuple[ModelArch, GpuSpec, Workload]:
    """Model, GPU and workload of one deployment; errors carry the deployment's file:line."""
    from kvpolicy.inputs.catalog import gpu_and_count, resolve_model
    from kvpolicy.inputs.workload import make_workload

    where = _where(loaded, dep)
    try:
        arch = resolve_model(_model_spec(loaded, dep.model), where=f"{where}: model").with_weights_gb(
            dep.weights_gb, "weights_gb:")
        # `gpu: 2xh100` sets tp 2 unless the deployment writes `tp:` itself.
        gpu, tp = gpu_and_count(dep.gpu, dep.tp if "tp" in dep.model_fields_set else None,
                                where=f"{where}: gpu", count_where="tp")
        workload = make_workload(loaded, context=dep.context, priority=dep.priority, concurrency=dep.concurrency,
                                 tp=tp, accuracy_floor=dep.accuracy_floor,
                                 gpu_memory_utilization=dep.gpu_memory_utilization)
    except KvPolicyError as exc:
        text = str(exc)
        if not text.startswith(where):
            raise type(exc)(f"{where}: {text}") from None
        raise
    return arch, gpu, workload


def evaluate(loaded: LoadedPolicy, dep: Deployment) -> Recommendation:
    """The recommendation for one deployment."""
    from kvpolicy.outputs.recommend import recommend

    arch, gpu, workload = deployment_inputs(loaded, dep)
    try:
        return recommend(arch, gpu, workload, loaded)
    except KvPolicyError as exc:
        err = type(exc)(f"{_where(loaded, dep)}: {exc}")
        err.__dict__.update(vars(exc))  # keeps LimitError.field
        raise err from None


def check_deployment(loaded: LoadedPolicy, dep: Deployment) -> dict[str, object]:
    """Decision, capacity, warnings and violations of one deployment (plain data for check's outputs).

    Violations (exit code 1): vLLM would refuse to start (the weights, or one request at
    the context, do not fit); the chosen cache cannot hold the deployment's concurrency at
    its context; uncalibrated scales are expected below the deployment's accuracy floor and
    the served checkpoint does not (visibly) carry the calibrated scales the decision needs.
    What stock vLLM cannot carry out (`Recommendation.unsupported`, the list
    `apply --strict` refuses) joins the warnings, so `check --strict` refuses exactly
    that too.
    """
    file, line, col = Sources.of(loaded).deployment(dep.name)
    out: dict[str, object] = {"name": dep.name, "file": file, "line": line, "col": col}
    try:
        rec = evaluate(loaded, dep)
    except KvPolicyError as exc:
        return {**out, "status": "error", "error": str(exc)}
    est, wl, d = rec.estimates, rec.workload, rec.decision
    violations = []
    if rec.blockers:
        violations += [f"vLLM would refuse to start: {b}" for b in rec.blockers]
    elif est.max_concurrency.value is not None and est.max_concurrency.value < wl.concurrency:
        held = int(est.max_concurrency.value)
        violations.append(f"{d.kv_cache_dtype} holds {held} {noun(held, 'request')} of "
                          f"{wl.context_tokens:,} tokens; the deployment needs {wl.concurrency}. Lower the "
                          "concurrency or context, or raise `tp`.")
    recovery = est.accuracy_recovery.value
    below = None
    if est.accuracy_recovery.unit == "ratio":
        if recovery is not None and recovery < wl.accuracy_floor:
            # The figure is uncalibrated FP8's: it stands unless the checkpoint served already carries the scales.
            below = (f"expected accuracy recovery {recovery:.0%} with uncalibrated scales is below the floor "
                     f"{wl.accuracy_floor:.0%}")
    else:
        # A model-level figure recorded for this model: judged by the `model_*` thresholds, as the rules judge it;
        # the recovery at the context they also read still counts.
        from kvpolicy.formats import FORMATS

        key = "fp8" if FORMATS[d.kv_cache_dtype].kind == "fp8" else d.kv_cache_dtype
        facts = rec.trace.facts
        context = facts.get(f"accuracy.{key}_recovery")
        if facts.get(f"accuracy.{key}_model_check") == "below":
            below = f"uncalibrated {key} fails the model-level check recorded for {rec.model}"
        elif context is not None and context < wl.accuracy_floor:
            below = (f"expected accuracy recovery {context:.0%} at {wl.context_tokens:,} tokens with uncalibrated "
                     f"scales is below the floor {wl.accuracy_floor:.0%}")
    if below is not None:
        if d.scale_source == "uncalibrated":
            violations.append(f"{below}; calibrate scales or keep BF16.")
        else:
            from kvpolicy.outputs.calibrate import scale_gap

            if scale_gap(d, _model_spec(loaded, dep.model)):
                violations.append(f"{below}, and `{dep.model}` is not a local checkpoint with the "
                                  f"{d.scale_source.replace('_', ' ')} scales the decision needs: "
                                  f"`kvpolicy calibrate -d {dep.name}` writes the recipe; serve the calibrated "
                                  "checkpoint (the deployment's `model`).")
    return {**out, "status": "violation" if violations else "ok", "violations": violations,
            "warnings": rec.warnings + [f"stock vLLM cannot carry out: {g}" for g in rec.unsupported],
            "advice": rec.alternatives, "decision": d.model_dump(),
            "vllm_args": rec.vllm_args,
            "decided_by": {k: v.decided_by for k, v in rec.trace.fields.items()},
            "capacity": {"max_concurrency": est.max_concurrency.value, "concurrency": wl.concurrency,
                         "kv_capacity_tokens": est.kv_capacity_tokens.value,
                         "capacity_vs_bf16": est.capacity_vs_bf16.value},
            "accuracy_recovery": recovery, "model": rec.model, "gpu": rec.gpu, "tp": wl.tp, "policy": rec.policy}
