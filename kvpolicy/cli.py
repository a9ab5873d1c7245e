"""Command-line entry point: a command table with lazy imports.

Only the chosen command's module is imported, so `kvpolicy --help`,
`recommend`, `lint`, `test` and `explain` never load torch, triton or vllm.
Exit codes: 0 ok, 1 policy or test failures, 2 usage or input errors,
3 internal error (a bug: rerun with --debug and report it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvpolicy import __version__
from kvpolicy.errors import EXIT_USAGE, KvPolicyError, did_you_mean

EXIT_INTERNAL = 3

# name -> (module, summary). The module defines configure(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "recommend": ("kvpolicy.commands.recommend", "Recommend KV-cache settings for a model on a GPU."),
    "explain": ("kvpolicy.commands.recommend", "Show the full rule trace of one decision."),
    "plan": ("kvpolicy.commands.plan", "Choose the KV format and TP size for a traffic and TTFT/TPOT targets."),
    "init": ("kvpolicy.commands.policy", "Write a commented starter policy and its tests in this folder."),
    "lint": ("kvpolicy.commands.policy", "Find schema errors, unreachable/shadowed rules and bad thresholds."),
    "test": ("kvpolicy.commands.policy", "Run the policy unit tests (*_test.yaml) next to each policy."),
    "check": ("kvpolicy.commands.policy", "Evaluate every deployment of a policy: decisions, capacity, warnings."),
    "diff": ("kvpolicy.commands.policy", "Show how a policy change alters each deployment's decision, and why."),
    "rule": ("kvpolicy.commands.catalogs", "Print a rule's statement, why-text and evidence (e.g. KV106)."),
    "facts": ("kvpolicy.commands.catalogs", "List the facts rules can test."),
    "models": ("kvpolicy.commands.catalogs", "List the model catalog."),
    "gpus": ("kvpolicy.commands.catalogs", "List the GPU catalog."),
    "bench": ("kvpolicy.commands.runtime", "Time decode attention of BF16 and the decision on this GPU; --record it."),
    "verify": ("kvpolicy.commands.runtime", "Needle-test the decision's KV formats against BF16 on this GPU."),
    "schema": ("kvpolicy.commands.catalogs", "Write the JSON Schemas (policy, tests, recommendation, service) to schemas/."),
    "serve": ("kvpolicy.commands.serve", "Serve the policy as an HTTP JSON decision service (needs the serve extra)."),
    "apply": ("kvpolicy.commands.apply", "Launch vLLM with the decision, validated by vLLM itself (--dry-run, --emit-config)."),
    "calibrate": ("kvpolicy.commands.calibrate", "Write the llm-compressor recipe for calibrated FP8 KV scales."),
}


def _command_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines)


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpolicy",
        description="Declarative KV-cache quantization policy for vLLM.",
        epilog=_command_help() + "\n\nExit codes: 0 ok, 1 policy/test failures, 2 usage or input errors, "
        "3 internal error.\nRun `kvpolicy COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvpolicy {__version__}")
    parser.add_argument("command", nargs="?", help="command to run")
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors with our exit code and one clear line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}. See `{self.prog} --help`.\n")
        raise SystemExit(EXIT_USAGE)


def build_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """Parser and module of one command (imports only that command's module)."""
    module_name, summary = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = _Parser(prog=f"kvpolicy {name}", description=summary)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--allow-extends-outside", action="store_true",
                        help="let a policy's `extends:` read files outside its git repository (or its folder)")
    module.configure(name, parser)  # type: ignore[attr-defined]
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--version"):
        try:
            _top_parser().parse_args(argv or ["--help"])
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        sys.stderr.write(f"kvpolicy: unknown command `{name}`.{did_you_mean(name, COMMANDS)} "
                         "Run `kvpolicy --help` for the list.\n")
        return EXIT_USAGE
    debug = "--debug" in argv
    try:
        parser, module = build_parser(name)
        args = parser.parse_args(argv[1:])
        args.command = name
        from kvpolicy.inputs.policy_loader import EXTENDS_ANYWHERE

        token = EXTENDS_ANYWHERE.set(bool(args.allow_extends_outside))
        try:
            return int(module.run(args) or 0)  # type: ignore[attr-defined]
        finally:
            EXTENDS_ANYWHERE.reset(token)
    except KvPolicyError as exc:
        if debug:
            raise
        sys.stderr.write(f"kvpolicy {name}: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if debug:
            raise
        if isinstance(exc, OSError) and exc.filename is not None:
            # A path the user named that the OS refuses (too long, a loop of links): their input, not our bug.
            sys.stderr.write(f"kvpolicy {name}: error: {str(exc.filename)[:200]}: {exc.strerror}. "
                             "Check the path.\n")
            return EXIT_USAGE
        sys.stderr.write(f"kvpolicy {name}: internal error: {type(exc).__name__}: {exc}. "
                         "Rerun with --debug for the traceback and report it.\n")
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
