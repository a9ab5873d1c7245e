"""`kvpolicy calibrate`: the llm-compressor recipe for the FP8 KV scales a decision needs.

kvpolicy does not calibrate: it writes the recipe (`kv_cache_scheme`, strategy
`tensor` or `attn_head` from the decision's scale source) and prints the command
that runs it with llm-compressor, and how to install that when it is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpolicy.commands.common import bounded_int
from kvpolicy.errors import InputError


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of calibrate."""
    from kvpolicy.commands.apply import add_target_args

    add_target_args(parser)
    parser.add_argument("--emit-recipe", metavar="FILE", help="write the recipe here (default: print it); "
                        "an existing FILE needs --force")
    parser.add_argument("--force", action="store_true", help="let --emit-recipe replace an existing file")
    parser.add_argument("--strategy", choices=["tensor", "attn_head"],
                        help="scale granularity (default: the decision's: per-head -> attn_head, per-tensor -> tensor)")
    parser.add_argument("--dataset", default="open_platypus", help="calibration dataset for llm-compressor's oneshot")
    parser.add_argument("--num-samples", type=bounded_int("--num-samples", 1, 10_000_000), default=512, help="calibration samples (default 512)")
    parser.add_argument("--output-dir", help="where llm-compressor saves the calibrated checkpoint")
    parser.epilog = "Example: kvpolicy calibrate -m kimi-k2.5 -g h200 -c 128k --emit-recipe recipe.yaml"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _note(text: str) -> None:
    sys.stderr.write(f"kvpolicy calibrate: {text}\n")


def run(args: argparse.Namespace) -> int:
    """Write (or print) the recipe and the command that runs it."""
    from kvpolicy.commands.apply import decide
    from kvpolicy.outputs.calibrate import (INSTALL_HINT, checkpoint_strategy, has_llmcompressor, oneshot_command,
                                            recipe_yaml, shell_line, strategy_for)

    if args.emit_recipe:
        from kvpolicy.inputs.safeio import check_writable

        check_writable(args.emit_recipe, force=args.force, what="--emit-recipe file")
    rec, arch, model_ref = decide(args)
    source = rec.decision.scale_source
    if rec.trace.fields["scale_source"].decided_by == "checkpoint" and not args.strategy:
        where = arch.kv_cache_scheme.source if arch.kv_cache_scheme else "kv_cache_scheme"
        _note(f"{rec.model}: the checkpoint already declares FP8 KV scales ({where}) and vLLM loads them (scale "
              f"source {source}). Nothing to calibrate; pass --strategy tensor|attn_head to write a recipe anyway.")
        return 0
    strategy = args.strategy or strategy_for(rec.decision)
    if strategy is None:
        _note(f"{rec.model} on {rec.gpu}: the decision's scale source is `{source}` (kv-cache-dtype "
              f"{rec.decision.kv_cache_dtype}), which needs no calibrated checkpoint. Nothing to calibrate; "
              "pass --strategy tensor|attn_head to write a recipe anyway.")
        return 0
    if args.num_samples <= 0:
        raise InputError(f"--num-samples must be positive, found {args.num_samples}.")
    found = checkpoint_strategy(model_ref)
    if found:
        _note(f"note: {model_ref} already carries calibrated KV scales (strategy {found}).")
    suffix = "head" if strategy == "attn_head" else "tensor"
    output_dir = args.output_dir or f"{Path(model_ref).name or arch.id}-kv-fp8-{suffix}"
    header = (f"llm-compressor recipe written by kvpolicy calibrate: FP8 KV-cache scales, strategy {strategy}\n"
              f"for {rec.model} on {rec.gpu} (policy {rec.policy}, scale source {source}). Weights stay as they are.")
    text = recipe_yaml(strategy, header=header)
    recipe_path = args.emit_recipe or "recipe.yaml"
    command = oneshot_command(model_ref, recipe_path, output_dir, dataset=args.dataset, num_samples=args.num_samples)
    if args.emit_recipe:
        from kvpolicy.inputs.safeio import write_text

        write_text(args.emit_recipe, text, force=args.force, what="--emit-recipe file")
        _note(f"wrote {args.emit_recipe} (kv_cache_scheme, strategy {strategy}); run it with:")
        print(shell_line(command))
    else:
        print(text, end="")
        _note(f"save this as {recipe_path} and run: {shell_line(command)}")
    if not has_llmcompressor():
        _note(f"llm-compressor is not installed here: `{INSTALL_HINT}` (calibrating a real model needs a GPU).")
    _note(f"then serve the calibrated checkpoint: kvpolicy apply --model {output_dir} --gpu {rec.gpu}")
    return 0
