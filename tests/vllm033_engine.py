"""Build vLLM 0.33's engine config from a local config folder and an argument list, for tests/test_vllm_accepts.py.

Executed by the vLLM 0.33 interpreter (`VLLM033_PYTHON`, not kvpolicy's environment) with
VLLM_TARGET_DEVICE=cpu: reads JSON cases on stdin (`{"folder": DIR, "args": [...]}`), writes one
JSON line per case: `{"ok": true, "max_model_len", "cache_dtype", "tp"}` when
`EngineArgs.create_engine_config()` accepts the arguments, else `{"ok": false, "stage", "error"}`.
`stage` is `config` when vLLM cannot read the folder's config itself (an architecture transformers
does not know without remote code), so the caller can tell that from a refused argument.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def build(folder: str, args: list[str]) -> dict:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    # Tokenizer and weights are not in the folder; neither matters to the engine config.
    ns = parser.parse_args(["--model", folder, "--skip-tokenizer-init", "--load-format", "dummy", *args])
    engine_args = EngineArgs.from_cli_args(ns)
    try:
        model_config = engine_args.create_model_config()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        text = f"{type(exc).__name__}: {exc}"
        # Refusals of our arguments surface here too (max_model_len); only config reading is `config`.
        stage = "args" if "max_model_len" in text else "config"
        return {"ok": False, "stage": stage, "error": text[:600]}
    del model_config
    try:
        cfg = engine_args.create_engine_config()
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "stage": "args", "error": f"{type(exc).__name__}: {exc}"[:600]}
    return {"ok": True, "max_model_len": cfg.model_config.max_model_len, "cache_dtype": cfg.cache_config.cache_dtype,
            "tp": cfg.parallel_config.tensor_parallel_size}


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            case = json.loads(line)
            print("RESULT " + json.dumps(build(case["folder"], case["args"])), flush=True)


if __name__ == "__main__":
    main()
