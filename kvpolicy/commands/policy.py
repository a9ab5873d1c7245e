"""Policy-as-code commands: `init`, `lint`, `test`, `check`, `diff`.

Exit codes: 0 ok; 1 lint errors, failing tests or check violations (or, with
`--strict`, warnings; with `diff --exit-code`, a changed decision); 2 usage or
input errors (a file that cannot be read or loaded, an unknown deployment).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvpolicy.commands.common import positive_int
from kvpolicy.commands.policy_output import OUTPUT_FORMATS
from kvpolicy.errors import EXIT_OK, EXIT_POLICY_FAILURE, EXIT_USAGE, InputError
from kvpolicy.outputs.render import echo

DEFAULT_POLICY_FILE = "kvpolicy.yaml"
_POLICY_KEYS = re.compile(r"^(extends|rules|deployments|pins|thresholds|constraints|disable|order):", re.M)
_FOREIGN_KEYS = re.compile(r"^(apiVersion|kind|jobs|repos|on|hooks|services|groups):", re.M)


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of init / lint / test / check / diff."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "Exit codes: 0 ok, 1 policy or test failures, 2 usage or input errors."
    if name == "init":
        parser.add_argument("--dir", default=".", help="folder to write kvpolicy.yaml and kvpolicy_test.yaml in")
        parser.add_argument("--force", action="store_true", help="replace existing files")
        parser.add_argument("--name", default=None, help="policy name (default: the folder's name)")
        parser.add_argument("--schema-ref", default=None,
                            help="$schema reference for editors (URL or path); default: schemas/policy.schema.json "
                                 "when the repo has one, else a copy written to .kvpolicy/")
        return
    if name == "lint":
        parser.add_argument("paths", nargs="*", help="policy files, *_test.yaml files or folders (default: .)")
        parser.add_argument("--ignore", default="", help="comma-separated codes to skip, e.g. KVL104,KVL202")
        parser.add_argument("--strict", action="store_true", help="warnings fail too (exit 1)")
        parser.add_argument("--list-checks", action="store_true", help="print every check and exit")
    elif name == "test":
        parser.add_argument("paths", nargs="*", help="*_test.yaml files or folders searched recursively (default: .)")
        parser.add_argument("--run", default=None, help="run only cases whose name matches this regex")
        parser.add_argument("--fail-on-empty", action="store_true", help="exit 1 when no case ran")
        parser.add_argument("--verbose", "-v", action="store_true", help="list passing cases and their trace too")
    elif name == "check":
        parser.add_argument("policy", nargs="?", default=None, help=f"policy file (default: ./{DEFAULT_POLICY_FILE})")
        parser.add_argument("--deployment", "-d", action="append", default=[],
                            help="check only this deployment (repeatable)")
        parser.add_argument("--strict", action="store_true", help="rule warnings fail too (exit 1)")
        parser.add_argument("--fail-on-empty", action="store_true", help="exit 1 when the policy has no deployments")
    elif name == "diff":
        parser.add_argument("old", help="old policy: a file, or FILE@REV for a git revision")
        parser.add_argument("new", nargs="?", default=None, help="new policy file (default: OLD in the working tree)")
        parser.add_argument("--git-rev", default=None, help="compare OLD at this git revision with the working tree")
        parser.add_argument("--exit-code", action="store_true", help="exit 1 when any deployment's decision changes")
        parser.add_argument("--model", "-m", default=None, help="also compare this model (with --gpu)")
        parser.add_argument("--gpu", "-g", default=None, help="GPU for --model (2xh100: with --tp 2)")
        parser.add_argument("--context", "-c", default="32k", help="context for --model (default 32k)")
        parser.add_argument("--priority", choices=["decode", "prefill", "balanced"], default="decode",
                            help="priority for --model (default decode)")
        parser.add_argument("--concurrency", type=positive_int("--concurrency", 1_000_000), default=1,
                            help="concurrency for --model (default 1)")
        parser.add_argument("--tp", type=positive_int("--tp", 1024), default=None,
                            help="tensor-parallel size for --model (default 1, or the count in --gpu 2xh100)")
    parser.add_argument("--format", "-f", choices=OUTPUT_FORMATS, default="table",
                        help="table (people), json (machines), github (workflow annotations)")


def run(args: argparse.Namespace) -> int:
    """Dispatch to the command."""
    return {"init": _init, "lint": _lint, "test": _test, "check": _check, "diff": _diff}[args.command](args)


# -- init --------------------------------------------------------------------------------


def _init(args: argparse.Namespace) -> int:
    from kvpolicy.policy.starter import write_starter

    for line in write_starter(Path(args.dir), force=args.force, name=args.name, schema_ref=args.schema_ref):
        echo(line)
    return EXIT_OK


# -- lint --------------------------------------------------------------------------------


def discover_policies(paths: list[str]) -> list[Path]:
    """Files named, and policy / test files found in folders named (`.` when none)."""
    from kvpolicy.policy.testing import SKIP_DIRS, is_test_file

    found: list[Path] = []
    from kvpolicy.inputs.safeio import read_bytes

    for spec in paths or ["."]:
        p = Path(spec)
        if p.exists() and not p.is_dir():
            found.append(p)  # the loader says what is wrong with a FIFO, a device or a huge file
            continue
        if not p.is_dir():
            raise InputError(f"{spec}: no such file or folder. Pass policy files or folders holding them.")
        for f in sorted(list(p.rglob("*.yaml")) + list(p.rglob("*.yml"))):
            parts = f.relative_to(p).parts[:-1]
            if set(parts) & SKIP_DIRS or any(part.startswith(".") for part in parts) or f.name.startswith("."):
                continue
            try:
                text = read_bytes(f, what="a policy file").decode("utf-8", "replace")[:65536]
            except InputError:
                found.append(f)  # linted, so that the refusal is reported with the file's name
                continue
            is_policy = _POLICY_KEYS.search(text) and not _FOREIGN_KEYS.search(text)
            if is_policy or (is_test_file(f) and re.search(r"^cases:", text, re.M)):
                found.append(f)
    return list(dict.fromkeys(found))


def _lint(args: argparse.Namespace) -> int:
    from kvpolicy.commands.policy_output import render_checks, render_lint
    from kvpolicy.policy.lint import is_load_failure, lint_path
    from kvpolicy.policy.lint_checks import BY_CODE, CHECKS

    if args.list_checks:
        render_checks(CHECKS, "json" if args.format == "json" else "table")
        return EXIT_OK
    ignore = {c.strip().upper() for c in args.ignore.split(",") if c.strip()}
    unknown = sorted(ignore - set(BY_CODE))
    if unknown:
        from kvpolicy.errors import did_you_mean

        raise InputError(f"--ignore: unknown code `{unknown[0]}`.{did_you_mean(unknown[0], BY_CODE)} "
                         "`kvpolicy lint --list-checks` lists them.")
    files = discover_policies(args.paths)
    if not files:
        raise InputError(f"no policy files found under {', '.join(f'`{p}`' for p in args.paths) or '`.`'}. Pass a file, or create one "
                         "with `kvpolicy init`.")
    findings = []
    seen: set[tuple[object, ...]] = set()
    load_failed = False
    for f in files:
        found = lint_path(f)
        load_failed |= is_load_failure(found)
        for x in found:
            key = (x.code, x.file, x.line, x.col, x.message)
            # A file that others extend is linted with each of them: report its findings once.
            if x.code not in ignore and key not in seen:
                seen.add(key)
                findings.append(x)
    render_lint(findings, len(files), args.format)
    if load_failed:
        return EXIT_USAGE
    # Notes (severity info) inform and never fail, not even under --strict.
    failing = [f for f in findings if f.severity == "error" or (args.strict and f.severity == "warning")]
    return EXIT_POLICY_FAILURE if failing else EXIT_OK


# -- test --------------------------------------------------------------------------------


def _test(args: argparse.Namespace) -> int:
    from kvpolicy.commands.policy_output import render_tests
    from kvpolicy.policy.testing import discover, run_file

    try:
        pattern = re.compile(args.run) if args.run else None
    except re.error as exc:
        raise InputError(f"--run {args.run!r}: not a valid regular expression ({exc}).") from None
    files = discover(args.paths)
    results = [run_file(f, pattern) for f in files]
    fired: dict[str, set[str]] = {}
    rules: dict[str, list[str]] = {}
    for fr in results:
        if fr.error:
            continue
        rules.setdefault(fr.policy_file, fr.rules)
        fired.setdefault(fr.policy_file, set()).update(x for c in fr.cases for x in c.fired)
    coverage = {p: {"rules": ids, "uncovered": [r for r in ids if r not in fired.get(p, set())]}
                for p, ids in rules.items()}
    counts = render_tests(results, coverage if pattern is None else {}, args.format, args.verbose)
    ran = counts["PASS"] + counts["FAIL"] + counts["ERROR"]
    if any(fr.error for fr in results):
        return EXIT_USAGE
    if counts["FAIL"] or counts["ERROR"]:
        return EXIT_POLICY_FAILURE
    if ran == 0:
        where = ", ".join(args.paths) or "."
        note = f"no test cases ran (searched {where} for *_test.yaml" + (f", --run {args.run}" if args.run else "") + ")"
        if args.format == "table":
            echo(note)
        return EXIT_POLICY_FAILURE if args.fail_on_empty else EXIT_OK
    return EXIT_OK


# -- check -------------------------------------------------------------------------------


def _policy_path(given: str | None) -> str:
    if given:
        return given
    if not Path(DEFAULT_POLICY_FILE).is_file():
        raise InputError(f"no {DEFAULT_POLICY_FILE} in {Path.cwd()}. Pass the policy file, or create one with "
                         "`kvpolicy init`.")
    return DEFAULT_POLICY_FILE


def _check(args: argparse.Namespace) -> int:
    from kvpolicy.commands.policy_output import render_check
    from kvpolicy.policy.deployments import check_deployment, find_deployment
    from kvpolicy.rules.validate import load_policy

    loaded = load_policy(_policy_path(args.policy))
    deps = [find_deployment(loaded, n) for n in args.deployment] or loaded.policy.deployments
    if not deps:
        if args.format == "table":
            echo(f"{loaded.chain[0]} has no deployments: add a `deployments:` list (name, model, gpu, context, "
                 "priority, concurrency, tp) to check them.")
        elif args.format == "json":
            render_check(loaded.label, [], "json")
        return EXIT_POLICY_FAILURE if args.fail_on_empty else EXIT_OK
    results = [check_deployment(loaded, d) for d in deps]
    render_check(loaded.label, results, args.format, strict=args.strict)
    if any(r["status"] == "error" for r in results):
        return EXIT_USAGE
    failed = any(r["status"] == "violation" or (args.strict and r.get("warnings")) for r in results)
    return EXIT_POLICY_FAILURE if failed else EXIT_OK


# -- diff --------------------------------------------------------------------------------


def _diff(args: argparse.Namespace) -> int:
    from kvpolicy.commands.policy_output import render_diff
    from kvpolicy.inputs.policy_schema import Deployment
    from kvpolicy.inputs.policy_sources import Sources
    from kvpolicy.policy.diff import compare, load_side, policy_changes, split_revision

    if args.git_rev is not None:
        if args.new is not None:
            raise InputError("--git-rev compares one file with itself at a revision: pass one file "
                             "(`kvpolicy diff team.yaml --git-rev HEAD~1`), or two files without --git-rev.")
        old_label, old = load_side(args.old, args.git_rev)
        new_label, new = load_side(args.old)
    else:
        new_spec = args.new
        if new_spec is None:
            path, rev = split_revision(args.old)
            if rev is None:
                raise InputError("give two policies (`kvpolicy diff OLD.yaml NEW.yaml`), FILE@REV "
                                 "(`kvpolicy diff team.yaml@HEAD~1`) or --git-rev REV.")
            new_spec = path
        old_label, old = load_side(args.old)
        new_label, new = load_side(new_spec)
    extra = []
    if args.model or args.gpu:
        if not (args.model and args.gpu):
            raise InputError("--model and --gpu go together, e.g. `--model llama-3.1-8b --gpu h100`.")
        # An unset --tp stays unset, so a count in --gpu (2xh100) gives it.
        tp = {} if args.tp is None else {"tp": args.tp}
        extra.append(Deployment(name=f"{args.model} on {args.gpu}", model=args.model, gpu=args.gpu,
                                context=args.context, priority=args.priority, concurrency=args.concurrency, **tp))
    diffs = compare(old, new, extra)
    render_diff(old_label, new_label, policy_changes(old.policy, new.policy), diffs, new.chain[0],
                Sources.of(new), args.format)
    if args.exit_code and any(d.status in ("changed", "added", "removed", "error") for d in diffs):
        return EXIT_POLICY_FAILURE
    return EXIT_OK
