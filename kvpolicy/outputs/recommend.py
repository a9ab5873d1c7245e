"""The whole flow for one deployment: inputs -> facts -> rules -> decision -> estimates and vLLM flags.

It sits with the outputs because a Recommendation carries the `vllm serve` flags
(`vllm_flags.serve_args`). `recommend()` is what the CLI, `kvpolicy check`, the
HTTP service and `apply` call; nothing else assembles a Recommendation.
"""

from __future__ import annotations

from kvpolicy.facts.build import build_facts
from kvpolicy.errors import PolicyError
from kvpolicy.facts.estimates import Figures, estimate
from kvpolicy.facts.limits import check_request, startup_blockers
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_loader import LoadedPolicy
from kvpolicy.inputs.workload import Workload
from kvpolicy.outputs.compat import unsupported
from kvpolicy.outputs.vllm_flags import serve_args
from kvpolicy.rules.decision import Decision, EvidenceRef, Recommendation, Trace
from kvpolicy.rules.engine import decide


def recommend(arch: ModelArch, gpu: GpuSpec, workload: Workload, loaded: LoadedPolicy) -> Recommendation:
    """Decide the KV cache for one deployment and explain it.

    A context or TP size vLLM refuses raises LimitError before anything is decided.
    """
    limit_warnings = check_request(arch, workload)
    # load_policy() already rejected unknown facts, thresholds and dtypes.
    policy = loaded.policy
    figures = Figures.shared(policy, arch, gpu, workload)
    facts = build_facts(arch, gpu, workload, policy, figures=figures)
    outcome = decide(policy, facts)
    decision = outcome.decision
    try:
        figures.layout(decision.kv_cache_dtype, decision.skip_layers)
    except ValueError as exc:  # the format's own size rule refuses this model's heads (formats.py)
        who = outcome.trace["fields"]["kv_cache_dtype"]["decided_by"]
        raise PolicyError(
            f"{who} decided --kv-cache-dtype {decision.kv_cache_dtype} for {arch.id}, which vLLM 0.33 cannot store "
            f"for this model: {exc}. Limit that rule or pin to models it fits (e.g. on model.attention or "
            "model.id), or forbid the dtype.") from None
    ests = estimate(figures, decision.kv_cache_dtype, decision.skip_layers, outcome.trace["facts"])
    by_id = {e.id: e for e in policy.evidence}
    # Model-level figures recorded for this model (`verify --record`): what the accuracy estimate and facts read.
    checks = [figures.model_check(decision.kv_cache_dtype, decision.scale_source), figures.model_check("fp8"),
              figures.model_check("fp8", "checkpoint_per_head"), figures.model_check("turboquant_4bit_nc")]
    cited = list(dict.fromkeys([*outcome.evidence_ids, *(c.evidence for c in checks if c is not None)]))
    evidence = [EvidenceRef(id=i, statement=by_id[i].statement, source=by_id[i].source)
                for i in cited if i in by_id]
    return Recommendation(
        model=arch.id,
        gpu=gpu.id,
        workload=workload,
        policy=loaded.label,
        decision=decision,
        vllm_args=serve_args(decision, workload),
        estimates=ests,
        warnings=limit_warnings + _checkpoint_notes(arch, decision) + outcome.warnings,
        blockers=startup_blockers(arch, gpu, workload, decision.kv_cache_dtype, decision.skip_layers),
        alternatives=outcome.alternatives,
        unsupported=unsupported(decision, arch, gpu, workload.tp),
        evidence=evidence,
        trace=Trace.model_validate(outcome.trace),
    )


def _checkpoint_notes(arch: ModelArch, decision: Decision) -> list[str]:
    """What `--kv-cache-dtype auto` means for a checkpoint whose quantization config quantizes the KV cache."""
    if decision.kv_cache_dtype != "auto" or arch.auto_kv_dtype == "auto":
        return []
    return [f"--kv-cache-dtype auto stores {arch.auto_kv_dtype} for this checkpoint ({arch.auto_kv_basis}); "
            f"the figures are {arch.auto_kv_dtype}'s. To keep the model dtype instead, pass --kv-cache-dtype "
            f"{arch.model_dtype} (an explicit dtype wins)."]
