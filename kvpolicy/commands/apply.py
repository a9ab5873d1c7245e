"""`kvpolicy apply`: turn a decision into a running vLLM server, validated by vLLM itself.

The decision becomes a `vllm serve` argument list spelled for the target vLLM
version (`kvpolicy.outputs.vllm_flags`); the user's flags after `--` win. The installed
vLLM's own parser and CacheConfig check it (`kvpolicy.outputs.vllm_launch`); then
`--dry-run` prints it, `--emit-config` writes it as a `vllm serve --config` file,
and otherwise vLLM replaces this process. Notes go to stderr, the command of a
dry run to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpolicy.commands.common import add_deployment_args
from kvpolicy.errors import InputError, PolicyFailure

if TYPE_CHECKING:
    from kvpolicy.inputs.arch import ModelArch
    from kvpolicy.rules.decision import Recommendation


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """--model/--gpu and the workload (or --deployment), shared with `calibrate`."""
    add_deployment_args(parser, model_required=False)
    parser.add_argument("--deployment", "-d", metavar="NAME",
                        help="a deployment from the policy's `deployments:` (--policy, default ./kvpolicy.yaml; "
                             "gives model, GPU and workload)")


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of apply."""
    from kvpolicy.outputs.vllm_launch import PYTHON_ENV

    add_target_args(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the vLLM command instead of starting it")
    parser.add_argument("--emit-config", metavar="FILE", help="write a YAML file for `vllm serve --config FILE` "
                        "instead of starting vLLM (an existing FILE needs --force)")
    parser.add_argument("--force", action="store_true", help="let --emit-config replace an existing file")
    parser.add_argument("--strict", action="store_true",
                        help="refuse (exit 1) when stock vLLM cannot carry out the decision")
    parser.add_argument("--vllm-version", metavar="VER",
                        help="spell the flags for this vLLM version (default: the installed one)")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help=f"python of the environment that has vLLM (default: ${PYTHON_ENV}, else this one)")
    parser.add_argument("--no-validate", action="store_true", help="skip vLLM's own check of the arguments")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="after `--`: more `vllm serve` flags; a flag given here wins over the decision's")
    parser.epilog = (
        "Examples:\n"
        "  kvpolicy apply -m llama-3.1-8b-instruct -g h100 -c 128k -- --port 8000\n"
        "  kvpolicy apply -m gpt-oss-20b -g h100 --dry-run\n"
        "  kvpolicy apply -p team.yaml -d chat --emit-config chat.yaml"
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def user_vllm_args(raw: list[str]) -> list[str]:
    """The flags after `--`; a stray word before it is a usage error."""
    if not raw:
        return []
    if raw[0] != "--":
        raise InputError(f"unexpected `{raw[0]}`: put vLLM's own flags after `--`, "
                         "e.g. `kvpolicy apply -m M -g G -- --port 8000`.")
    return raw[1:]


def user_config_keys(user_args: list[str], emit_config: str | None) -> dict[str, str]:
    """Flags set by the user's own `--config FILE` after `--`, as `--key` -> `key in FILE`."""
    from kvpolicy.outputs.vllm_flags import canonical_flag, option_groups, option_value

    files = [option_value(tokens) for flag, tokens in option_groups(user_args) if flag == "--config"]
    if not files:
        return {}
    if emit_config:
        raise InputError(f"--emit-config cannot wrap your own --config {files[0]}: merge it into the written "
                         "file or pass its flags after `--`.")
    from kvpolicy.inputs.safeio import read_text
    from kvpolicy.inputs.yamlio import load_safe

    try:
        data = load_safe(read_text(files[0], what="a vLLM --config file"), files[0])
    except InputError as exc:
        raise InputError(f"--config (after `--`): {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"--config {files[0]}: expected a mapping of vLLM option names to values.")
    return {canonical_flag(f"--{key}") or f"--{key}": f"{key} in {files[0]}" for key in data}


def decide(args: argparse.Namespace) -> tuple[Recommendation, ModelArch, str]:
    """The recommendation for --model/--gpu or --deployment, its model, and the model as vLLM loads it."""
    from kvpolicy.commands.common import deployment_inputs_from_args, resolve_inputs
    from kvpolicy.outputs.compat import model_for_vllm
    from kvpolicy.outputs.recommend import recommend

    if args.deployment:
        inputs = deployment_inputs_from_args(args)
    else:
        if not args.model or not args.gpu:
            raise InputError("name the target: --model and --gpu (e.g. `--model gpt-oss-20b --gpu h100`), "
                             "or --deployment NAME from the policy (--policy, default ./kvpolicy.yaml).")
        inputs = resolve_inputs(args)
    arch, gpu, workload, loaded = inputs.arch, inputs.gpu, inputs.workload, inputs.loaded
    rec = recommend(arch, gpu, workload, loaded)
    return rec, arch, model_for_vllm(arch, args.model)


def _check_user_max_model_len(user_args: list[str], context: int) -> None:
    """A `--max-model-len` after `--` that is not the decision's context would launch vLLM at a length whose limit,
    format and memory no one checked: the context goes through --context instead."""
    from kvpolicy.outputs.vllm_flags import option_groups, option_value, vllm_human_int

    for flag, tokens in option_groups(user_args):
        if flag != "--max-model-len":
            continue
        text = option_value(tokens)
        value = vllm_human_int(text)
        if value is None:
            raise InputError(f"`{' '.join(tokens)}` after `--`: vLLM reads --max-model-len as a whole number, "
                             "1k = 1,000, 1K = 1,024, or -1 / auto; pass the context as --context instead.")
        if value == -1:
            _note(f"warning: --max-model-len {text}: vLLM fits the length to the memory it finds; the decision "
                  f"and its checks are for {context:,} tokens (--context)")
        elif value != context:
            raise InputError(f"`{' '.join(tokens)}` after `--` is {value:,} tokens, but the decision is for "
                             f"{context:,} (--context): pass --context {value} instead of --max-model-len, so that "
                             "the format, the model's length limit and the memory check follow the length vLLM "
                             "serves.")


def _note(text: str) -> None:
    sys.stderr.write(f"kvpolicy apply: {text}\n")


def run(args: argparse.Namespace) -> int:
    """Build, check and launch (or print / write) the vLLM command for the decision."""
    from kvpolicy.outputs.vllm_flags import (LATEST_KNOWN, environment_notes, format_version, merge_user_args,
                                             option_groups, parse_version, plan_flags, realisation, retired_flag)
    from kvpolicy.outputs.vllm_launch import INSTALL_HINT, config_yaml, exec_vllm, find_vllm, shell_line, validate

    user_args = user_vllm_args(args.vllm_args)
    if args.emit_config:
        from kvpolicy.inputs.safeio import check_writable

        check_writable(args.emit_config, force=args.force, what="--emit-config file")
    for flag, tokens in option_groups(user_args):
        if flag is None or flag == "--model":
            raise InputError(f"`{' '.join(tokens)}` after `--`: the model comes from --model or the deployment.")
    rec, arch, model_ref = decide(args)
    _check_user_max_model_len(user_args, rec.workload.context_tokens)
    install = find_vllm(args.vllm_python)
    try:
        version = parse_version(args.vllm_version) if args.vllm_version else install.version_tuple if install else None
    except ValueError as exc:
        raise InputError(f"--vllm-version: {exc}.") from None
    for flag, _ in option_groups(user_args):
        problem = retired_flag(flag, version or LATEST_KNOWN)
        if problem:
            raise InputError(problem)
    plan = plan_flags(rec.decision, rec.workload, version)
    flags, overrides = merge_user_args(plan, user_args, config_keys=user_config_keys(user_args, args.emit_config))
    command = (install.serve_command(model_ref) if install else ["vllm", "serve", model_ref]) + flags
    gaps = plan.gaps + rec.unsupported

    d = rec.decision
    skips = ", ".join(d.skip_layers) or "none"
    _note(f"{rec.model} on {rec.gpu}, policy {rec.policy}: kv-cache-dtype {d.kv_cache_dtype}, skip layers {skips}, "
          f"backend {d.attention_backend or 'chosen by vLLM'}")
    if realisation(d):
        _note(realisation(d))
    target = format_version(version) if version else f"newest known ({format_version(LATEST_KNOWN)})"
    where = f"{install.distribution} {install.version} in {install.python}" if install else "not installed here"
    _note(f"flags spelled for vLLM {target}; vLLM: {where}")
    if install and version and version != install.version_tuple:
        _note(f"warning: --vllm-version {args.vllm_version} differs from the installed vLLM {install.version}")
    for line in plan.notes + environment_notes(dict(os.environ), version) + overrides + \
            [f"warning: {w}" for w in rec.warnings]:
        _note(line)
    for gap in gaps:
        _note(f"warning: stock vLLM cannot carry out: {gap}")
    if args.strict and gaps:
        raise PolicyFailure("--strict: not launching, stock vLLM cannot carry out this decision: " + " ".join(gaps))
    if rec.blockers:  # before anything is printed, written or launched
        raise PolicyFailure("not launching, printing or writing a command that vLLM would refuse at start-up: "
                            + " ".join(rec.blockers))

    launching = not (args.dry_run or args.emit_config)
    if launching and install is None:
        raise InputError(f"vLLM is not installed in this environment ({sys.executable}): {INSTALL_HINT}. "
                         "--dry-run and --emit-config work without it.")
    if args.emit_config:
        header = (f"vllm serve config written by kvpolicy apply: {rec.model} on {rec.gpu}, policy {rec.policy}\n"
                  f"Start: {shell_line(_config_start(install, args.emit_config))}")
        from kvpolicy.inputs.safeio import write_text

        emitted = config_yaml(model_ref, flags, header=header, env=plan.env)
    if install is None:
        _note(f"not validated: vLLM is not installed here ({INSTALL_HINT})")
    elif args.no_validate:
        _note("not validated (--no-validate)")
    else:
        # vLLM's import and checks take seconds (14-24 s on a small CPU machine): say what the wait is.
        _note(f"checking the arguments with {install.distribution} {install.version} ({install.python}); vLLM takes "
              "a while to import ...")
        sys.stderr.flush()
        checked = _validate(validate, install, model_ref, flags, args.emit_config, plan.env,
                            emitted if args.emit_config else None)
        cpu = " (no GPU here: checked for the CPU platform)" if checked.forced_cpu else ""
        _note(f"validated by vLLM {checked.version}: {', '.join(checked.checked)}{cpu}")
    if args.emit_config:
        # Written only once vLLM accepted it: a refused config never lands on (or replaces) the target.
        write_text(args.emit_config, emitted, force=args.force, what="--emit-config file")
        start = shell_line(_config_start(install, args.emit_config), plan.env)
        _note(f"wrote {args.emit_config}; start vLLM with: {start}")
    if args.dry_run:
        print(shell_line(command, plan.env))
    if launching:
        _note(f"starting: {shell_line(command, plan.env)}")
        exec_vllm(command, plan.env)
    return 0


def _validate(validate, install, model_ref: str, flags: list[str], target: str | None, env: dict[str, str],  # noqa: ANN001
              emitted: str | None):  # noqa: ANN202
    """vLLM's check; an emitted config is checked from a private temp copy, since vLLM reads it by path."""
    if target is None or emitted is None:
        return validate(install, model_ref, flags, config=None, env=env)
    import tempfile

    folder = Path(target).parent if str(Path(target).parent) else Path(".")
    with tempfile.TemporaryDirectory(prefix=".kvpolicy-", dir=folder) as tmp:
        probe = Path(tmp) / Path(target).name
        probe.write_text(emitted, encoding="utf-8")
        return validate(install, model_ref, flags, config=str(probe), env=env)


def _config_start(install, path: str) -> list[str]:  # noqa: ANN001 - VllmInstall | None
    """The command that starts vLLM from an emitted config file (the model is in the file)."""
    prefix = install.serve_command(None) if install else ["vllm", "serve"]
    return [*prefix, "--config", path]
