"""Options and input resolution shared by the commands that evaluate one deployment."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from kvpolicy.errors import InputError
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_loader import LoadedPolicy
from kvpolicy.inputs.workload import Workload
from kvpolicy.rules.validate import load_policy


_INT = re.compile(r"[+-]?[0-9]{1,30}")
_FLOAT = re.compile(r"[+-]?([0-9]{1,30}\.?[0-9]{0,30}|\.[0-9]{1,30})([eE][+-]?[0-9]{1,4})?")


def bounded_int(flag: str, low: int, high: int):  # noqa: ANN201 - argparse type factory
    """argparse type: a whole number in low..high, with an error that names the flag and the range."""

    def parse(text: str) -> int:
        # ASCII digits only: Python's int() would also take `1_000` and full-width digits.
        value = int(text) if _INT.fullmatch(text.strip()) else None
        if value is None:
            raise argparse.ArgumentTypeError(f"{flag} expects a whole number in {low:,}..{high:,}, "
                                              f"found {text[:40]!r}")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} must be in {low:,}..{high:,}, found {value:,}")
        return value

    return parse


def positive_int(flag: str, high: int = 1 << 31):  # noqa: ANN201 - argparse type factory
    """argparse type: a positive integer (at most `high`), with an error that names the flag."""
    return bounded_int(flag, 1, high)


def bounded_float(flag: str, low: float, high: float, *, low_open: bool = False):  # noqa: ANN201
    """argparse type: a finite number in [low, high] ((low, high] with `low_open`)."""
    import math

    def parse(text: str) -> float:
        value = float(text) if _FLOAT.fullmatch(text.strip()) else math.nan
        shown = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{flag} expects a finite number in {shown}, found {text[:40]!r}")
        if not (low < value if low_open else low <= value) or value > high:
            raise argparse.ArgumentTypeError(f"{flag} must be in {shown}, found {value:g}")
        return value

    return parse


def positive_float(flag: str, high: float = 1e6):  # noqa: ANN201 - argparse type factory
    """argparse type: a positive, finite number (at most `high`)."""
    return bounded_float(flag, 0.0, high, low_open=True)


def unit_float(flag: str):  # noqa: ANN201 - argparse type factory
    """argparse type: a number in (0, 1]."""
    return bounded_float(flag, 0.0, 1.0, low_open=True)


def add_deployment_args(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    """--model, --gpu, workload options and --policy."""
    parser.add_argument("--model", "-m", required=model_required,
                        help="catalog id (gpt-oss-20b), Hugging Face id (openai/gpt-oss-20b), "
                             "or a local model folder / config.json")
    parser.add_argument("--gpu", "-g", required=model_required,
                        help="GPU id, alias or nvidia-smi name (h100, \"RTX 4090\", b200, a100, l40s...), or "
                             "`auto`; 2xh100 or h100x2 also sets --tp 2")
    parser.add_argument("--context", "-c", default="32k",
                        help="context length per request: 32k, 128k, 131072 (default 32k)")
    parser.add_argument("--priority", choices=["decode", "prefill", "balanced"], default="decode",
                        help="latency that matters most (default decode)")
    parser.add_argument("--concurrency", type=positive_int("--concurrency", 1_000_000), default=1,
                        help="requests served at once at that context (default 1)")
    parser.add_argument("--tp", type=positive_int("--tp", 1024), default=None,
                        help="tensor-parallel size (default 1, or the count in --gpu 2xh100)")
    parser.add_argument("--accuracy-floor", type=unit_float("--accuracy-floor"), default=None,
                        help="lowest acceptable accuracy recovery vs BF16 (default: the policy's, 0.95)")
    parser.add_argument("--gpu-memory-utilization", type=unit_float("--gpu-memory-utilization"), default=0.92,
                        help="fraction of GPU memory vLLM may use (default 0.92)")
    parser.add_argument("--weights-gb", type=positive_float("--weights-gb"), default=None,
                        help="weight memory in GB (1e9 bytes), all ranks together; overrides what kvpolicy derives "
                             "from the safetensors index or the config's shapes and quantization")
    parser.add_argument("--policy", "-p", default=None,
                        help="policy file (default: the built-in policy, builtin:default)")


@dataclass
class Inputs:
    """Everything one evaluation needs."""

    arch: ModelArch
    gpu: GpuSpec
    workload: Workload
    loaded: LoadedPolicy


def resolve_inputs(args: argparse.Namespace) -> Inputs:
    """Resolve the model, GPU, policy and workload named on the command line."""
    from kvpolicy.inputs.catalog import gpu_and_count, resolve_model
    from kvpolicy.inputs.workload import make_workload

    if not args.model or not args.gpu:
        raise InputError("--model and --gpu are required, e.g. `--model gpt-oss-20b --gpu h100`.")
    loaded = load_policy(args.policy)
    arch = resolve_model(args.model).with_weights_gb(getattr(args, "weights_gb", None))
    gpu, tp = gpu_and_count(args.gpu, args.tp)
    workload = make_workload(
        loaded, context=args.context, priority=args.priority, concurrency=args.concurrency, tp=tp,
        accuracy_floor=args.accuracy_floor, gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return Inputs(arch=arch, gpu=gpu, workload=workload, loaded=loaded)


DEFAULT_POLICY_FILE = "kvpolicy.yaml"


def deployment_inputs_from_args(args: argparse.Namespace) -> Inputs:
    """Inputs of `--deployment NAME`: from --policy, else ./kvpolicy.yaml (explain, apply, calibrate alike)."""
    from pathlib import Path

    from kvpolicy.policy.deployments import deployment_inputs, find_deployment

    if args.model or args.gpu:
        raise InputError("--deployment takes the model, GPU and workload from the policy; drop --model/--gpu "
                         "(or drop --deployment).")
    policy = args.policy
    if policy is None:
        if not Path(DEFAULT_POLICY_FILE).is_file():
            raise InputError(f"--deployment needs a policy with `deployments:`: pass --policy FILE "
                             f"(no {DEFAULT_POLICY_FILE} in this folder).")
        policy = DEFAULT_POLICY_FILE
    loaded = load_policy(policy)
    arch, gpu, workload = deployment_inputs(loaded, find_deployment(loaded, args.deployment))
    return Inputs(arch=arch, gpu=gpu, workload=workload, loaded=loaded)
