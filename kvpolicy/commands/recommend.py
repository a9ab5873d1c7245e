"""`kvpolicy recommend` and `kvpolicy explain`."""

from __future__ import annotations

import argparse

from kvpolicy.commands.common import add_deployment_args, resolve_inputs
from kvpolicy.render import FORMATS, render


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of recommend / explain."""
    add_deployment_args(parser)
    parser.add_argument("--format", "-f", choices=FORMATS, default="table",
                        help="table (people), json / yaml (machines), args (only the vLLM flags)")
    parser.epilog = (
        "Example: kvpolicy recommend --model gpt-oss-20b --gpu h100 --context 32k\n"
        "         vllm serve openai/gpt-oss-20b $(kvpolicy recommend -m gpt-oss-20b -g h100 --format args)"
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args: argparse.Namespace) -> int:
    """Evaluate one deployment and print the decision."""
    from kvpolicy.recommend import recommend

    inputs = resolve_inputs(args)
    rec = recommend(inputs.arch, inputs.gpu, inputs.workload, inputs.loaded)
    model_ref = inputs.arch.hf_id or args.model
    render(rec, args.format, model_ref=model_ref, explain=args.command == "explain")
    return 0
