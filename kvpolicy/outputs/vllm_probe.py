"""Asks the vLLM installation itself: which version it is, and whether it accepts a `vllm serve` argument list.

This file runs inside the Python that has vLLM (kvpolicy's own or another
environment's: `kvpolicy apply --vllm-python`), started by `kvpolicy.outputs.vllm_launch`
with an argument list, never a shell. It imports only the standard library and
vLLM, so kvpolicy need not be installed there. It reads one JSON request from
argv[1] and prints one line `KVPOLICY-PROBE <json>` (vLLM logs to stdout too).

Requests:
- `{"mode": "detect"}`: version and distribution from package metadata; vLLM is
  not imported (fast).
- `{"mode": "validate", "model": M, "args": [...], "config": FILE|null}`: vLLM's
  own `vllm serve` parser (`make_arg_parser`), its serve-argument checks,
  `AsyncEngineArgs.from_cli_args`, then `CacheConfig` built from those engine
  arguments (dtype, skip layers, memory fraction: pydantic rejects a bad dtype
  there). With a GPU visible and a local model folder, the full
  `create_engine_config()` too. With `config`, the file is parsed through vLLM's
  `--config` loader and must give the same arguments as the command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys

MARKER = "KVPOLICY-PROBE "


def detect() -> dict:
    """vLLM's version and distribution name, without importing it."""
    import importlib.metadata as md
    import importlib.util

    # Only the top-level spec: find_spec of a submodule would import vllm itself (seconds).
    if importlib.util.find_spec("vllm") is None:
        return {"installed": False}
    dists = md.packages_distributions().get("vllm", []) or ["vllm"]
    version = None
    for dist in dists:
        try:
            version = md.version(dist)
            break
        except md.PackageNotFoundError:
            continue
    return {"installed": True, "version": version, "distribution": dists[0], "python": sys.executable}


def _platform_unknown() -> bool:
    """True when vLLM cannot tell which device it runs on (a GPU build on a machine with no GPU)."""
    try:
        from vllm.platforms import resolve_current_platform_cls_qualname
    except ImportError:  # older vLLM: ask torch whether a GPU is visible
        import torch

        return not torch.cuda.is_available()
    return "Unspecified" in resolve_current_platform_cls_qualname()


def _serve_parser():
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the utils split
        from vllm.utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    except ImportError:
        try:
            from vllm.entrypoints.openai.cli_args import validate_parsed_serve_args
        except ImportError:
            validate_parsed_serve_args = None
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve")), validate_parsed_serve_args


def _parse(argv: list[str]):
    """Parse with vLLM's serve parser; (namespace, None) or (None, vLLM's error line)."""
    parser, check = _serve_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return None, (lines[-1] if lines else "the argument parser rejected the arguments")
    if getattr(ns, "model_tag", None):
        ns.model = ns.model_tag
    if check is not None:
        check(ns)
    return ns, None


def _error_text(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            parts = []
            for e in errors():
                loc = ".".join(str(p) for p in e.get("loc", ()))
                parts.append(f"{loc}: {e.get('msg')} (got {e.get('input')!r})" if loc else str(e.get("msg")))
            return "; ".join(parts)
        except Exception:  # noqa: BLE001 - fall back to the plain text
            pass
    return f"{type(exc).__name__}: {exc}"


def _cache_config(engine_args):
    """CacheConfig from the engine arguments, the way create_engine_config maps them."""
    from vllm.config import CacheConfig

    source = {"cache_dtype": "kv_cache_dtype"}
    kwargs = {}
    for f in dataclasses.fields(CacheConfig):
        name = source.get(f.name, f.name)
        if f.init and hasattr(engine_args, name) and getattr(engine_args, name) is not None:
            kwargs[f.name] = getattr(engine_args, name)
    return CacheConfig(**kwargs)


def validate(request: dict) -> dict:
    """Run vLLM's own checks on the argument list (and the config file)."""
    forced_cpu = False
    if not os.environ.get("VLLM_TARGET_DEVICE") and _platform_unknown():
        # Without it vLLM fails with "Failed to infer device type" on a machine with no GPU.
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        forced_cpu = True
    import vllm

    result = {"ok": False, "version": getattr(vllm, "__version__", None), "forced_cpu": forced_cpu, "checked": []}
    argv = ["--model", request["model"], *request["args"]]
    stage = "parser"
    try:
        ns, error = _parse(argv)
        if error:
            return {**result, "stage": stage, "error": error}
        result["checked"].append("vllm serve parser")
        stage = "engine arguments"
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs as Args
        except ImportError:
            from vllm.engine.arg_utils import EngineArgs as Args
        engine_args = Args.from_cli_args(ns)
        result["checked"].append("EngineArgs")
        stage = "CacheConfig"
        cache = _cache_config(engine_args)
        result["checked"].append("CacheConfig")
        result["cache_dtype"] = str(cache.cache_dtype)
        backend = getattr(engine_args, "attention_backend", None)
        if backend is not None:
            stage = "AttentionConfig"
            from vllm.config import AttentionConfig

            AttentionConfig(backend=backend)
            result["checked"].append("AttentionConfig")
        if request.get("config"):
            stage = "config file"
            from_file, error = _parse(["--config", request["config"]])
            if error:
                return {**result, "stage": stage, "error": error}
            differ = sorted(k for k, v in vars(ns).items() if vars(from_file).get(k) != v and k != "config")
            if differ:
                return {**result, "stage": stage,
                        "error": f"vLLM reads {request['config']} differently from the command line: {differ}"}
            result["checked"].append("config file round trip")
        if not forced_cpu and os.path.isdir(request["model"]):
            stage = "engine config"
            engine_args.create_engine_config()
            result["checked"].append("engine config")
    except Exception as exc:  # noqa: BLE001 - every rejection is reported, one line
        return {**result, "stage": stage, "error": _error_text(exc)}
    return {**result, "ok": True}


def main(argv: list[str]) -> int:
    """Answer one request; the answer is the last `KVPOLICY-PROBE` line on stdout."""
    request = json.loads(argv[0]) if argv else {"mode": "detect"}
    answer = detect() if request.get("mode") == "detect" else validate(request)
    sys.stdout.flush()
    print(MARKER + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
