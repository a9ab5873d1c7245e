"""`kvpolicy recommend` and `kvpolicy explain`."""

from __future__ import annotations

import argparse

from kvpolicy.commands.common import add_deployment_args, deployment_inputs_from_args, resolve_inputs
from kvpolicy.errors import EXIT_POLICY_FAILURE
from kvpolicy.outputs.render import FORMATS, render


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of recommend / explain."""
    add_deployment_args(parser, model_required=name != "explain")
    if name == "explain":
        parser.add_argument("--deployment", "-d", default=None,
                            help="explain this deployment of the policy (--policy, default ./kvpolicy.yaml) "
                                 "instead of --model/--gpu")
    parser.add_argument("--format", "-f", choices=FORMATS, default="table",
                        help="table (people), json / yaml (machines), args (only the vLLM flags)")
    parser.epilog = (
        "Example: kvpolicy recommend --model gpt-oss-20b --gpu h100 --context 32k\n"
        "         vllm serve openai/gpt-oss-20b $(kvpolicy recommend -m gpt-oss-20b -g h100 --format args)"
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args: argparse.Namespace) -> int:
    """Evaluate one deployment and print the decision."""
    from kvpolicy.outputs.compat import model_for_vllm
    from kvpolicy.outputs.recommend import recommend

    if args.command == "explain" and not args.deployment and not (args.model and args.gpu):
        from kvpolicy.errors import InputError

        raise InputError("explain needs --model and --gpu (e.g. `--model gpt-oss-20b --gpu h100`), or "
                         "--deployment NAME for a deployment of the policy (--policy, default ./kvpolicy.yaml).")
    inputs = deployment_inputs_from_args(args) if getattr(args, "deployment", None) else resolve_inputs(args)
    rec = recommend(inputs.arch, inputs.gpu, inputs.workload, inputs.loaded)
    model_ref = model_for_vllm(inputs.arch, args.model)
    render(rec, args.format, model_ref=model_ref, explain=args.command == "explain")
    # Exit 1 (the answer is "not like this") while vLLM would refuse the printed flags at start-up.
    return EXIT_POLICY_FAILURE if rec.blockers else 0

