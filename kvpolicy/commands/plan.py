"""`kvpolicy plan`: the KV format and TP size for a traffic and latency targets."""

from __future__ import annotations

import argparse

from kvpolicy.commands.common import positive_int, unit_float


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of plan."""
    parser.add_argument("--model", "-m", required=True, help="catalog id, Hugging Face id, or a local config")
    parser.add_argument("--gpu", "-g", required=True, help="GPU id or alias (h100, b200...); 4xh100 also sets --gpus 4")
    parser.add_argument("--gpus", type=positive_int("--gpus"), default=None,
                        help="GPUs to serve with (default 1, or the count in --gpu 4xh100); each TP size vLLM accepts up to it is tried, the "
                             "rest of the GPUs as data-parallel replicas")
    parser.add_argument("--traffic", "-t", required=True,
                        help="isl=20k,osl=1k and one load: rate=2/s (open loop), concurrency=64 (closed loop) or "
                             "burst=100 (at once; with rate=: bursts at that mean rate)")
    parser.add_argument("--slo", default="", help="latency targets, e.g. ttft=2s,tpot=40ms (default: none)")
    parser.add_argument("--accuracy-floor", type=unit_float("--accuracy-floor"), default=None,
                        help="lowest acceptable accuracy recovery vs BF16 (default: the policy's, 0.95)")
    parser.add_argument("--gpu-memory-utilization", type=unit_float("--gpu-memory-utilization"), default=0.92,
                        help="fraction of GPU memory vLLM may use (default 0.92)")
    parser.add_argument("--weights-gb", type=float, default=None,
                        help="weight memory in GB, all ranks together (overrides the derived figure)")
    parser.add_argument("--policy", "-p", default=None, help="policy file (default: builtin:default)")
    parser.add_argument("--format", "-f", choices=("table", "json"), default="table",
                        help="table (default) or json (the `POST /v1/plan` document)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="write the Pareto plot (tokens/s per user vs per GPU) here (needs the plot extra)")
    parser.add_argument("--force", action="store_true", help="replace an existing --plot file")
    parser.epilog = "Example: kvpolicy plan -m llama-3.3-70b -g h100 --gpus 4 -t isl=16k,osl=1k,concurrency=34 " \
                    "--slo ttft=2s,tpot=80ms"


def run(args: argparse.Namespace) -> int:
    """Evaluate the candidates under the traffic and print the plan."""
    from kvpolicy.inputs.catalog import gpu_and_count, resolve_model
    from kvpolicy.inputs.traffic import Slo, parse_slo, parse_traffic
    from kvpolicy.inputs.workload import make_workload
    from kvpolicy.outputs.compat import model_for_vllm
    from kvpolicy.outputs.plan import plan
    from kvpolicy.outputs.plan_render import plot_plan, render_plan
    from kvpolicy.rules.validate import load_policy

    if args.plot:
        from pathlib import Path

        from kvpolicy.errors import InputError

        if not args.plot.lower().endswith(".png"):
            raise InputError(f"--plot {args.plot}: the plot is a PNG; name the file FILE.png.")
        if Path(args.plot).exists() and not args.force:
            raise InputError(f"--plot {args.plot} exists; pass --force to replace it, or choose another name.")
    traffic = parse_traffic(args.traffic)
    slo = parse_slo(args.slo) if args.slo else Slo()
    loaded = load_policy(args.policy)
    floor = make_workload(loaded, accuracy_floor=args.accuracy_floor).accuracy_floor
    if args.weights_gb is not None and not args.weights_gb > 0:
        from kvpolicy.errors import InputError

        raise InputError(f"--weights-gb must be a positive number, found {args.weights_gb:g}")
    arch = resolve_model(args.model).with_weights_gb(args.weights_gb)
    gpu, gpus = gpu_and_count(args.gpu, args.gpus, count_where="--gpus")
    result = plan(arch, gpu, gpus, traffic, slo, loaded, accuracy_floor=floor,
                  gpu_memory_utilization=args.gpu_memory_utilization)
    if args.plot:
        import sys

        out = plot_plan(result, args.plot)
        sys.stderr.write(f"kvpolicy plan: wrote {out}\n")
    render_plan(result, args.format, model_ref=model_for_vllm(arch, args.model))
    return 0
