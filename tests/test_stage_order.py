"""The package follows the flow: inputs -> facts -> rules -> outputs -> policy tools -> service, runtime -> CLI.

Every import in kvpolicy/ (also the lazy ones inside functions and those under
TYPE_CHECKING) is read with `ast` and mapped to its stage; a module may import
its own stage or an earlier one, plus the stage-free leaves (`kvpolicy`,
`kvpolicy.errors`, `kvpolicy.formats`). Modules never import each other in a cycle. The kernels
import nothing of kvpolicy but themselves, and only the runtime imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpolicy"
# Installed as kvpolicy.kernels (package-dir remap) until the kernels move under kvpolicy/.
KERNELS = PACKAGE / "kernels" if (PACKAGE / "kernels").is_dir() else ROOT / "kernels"

TIERS: list[tuple[str, ...]] = [
    ("inputs",),
    ("facts",),
    ("rules",),
    ("outputs",),
    ("policy",),
    ("service", "runtime"),
    ("commands",),
]
"""Stages in flow order; stages in one tier are peers and may not import each other."""
RANK = {stage: i for i, tier in enumerate(TIERS) for stage in tier}
LEAVES = {"kvpolicy", "kvpolicy.errors", "kvpolicy.formats"}
"""Stage-free helpers any module may import (they import nothing of kvpolicy); `formats` is the KV format registry."""
TOP_LEVEL = {"kvpolicy.cli": "commands", "kvpolicy.__main__": "commands"}
"""Modules directly under kvpolicy/ and their stage."""


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package and of the kernels."""
    found: dict[str, Path] = {}
    for root, prefix in ((PACKAGE, "kvpolicy"), (KERNELS, "kvpolicy.kernels")):
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if root == PACKAGE and parts[0] == "kernels":
                continue  # read through KERNELS
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def stage(module: str) -> str:
    """The stage of a module: its folder under kvpolicy/, `kernels`, `leaf`, or a TOP_LEVEL entry."""
    if module in LEAVES:
        return "leaf"
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    parts = module.split(".")
    if len(parts) >= 2 and (parts[1] in RANK or parts[1] == "kernels"):
        return parts[1]
    raise AssertionError(f"{module}: no stage; put it in a stage folder or add it to TOP_LEVEL/LEAVES")


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (`kvpolicy.inputs.arch.ModelArch` -> `kvpolicy.inputs.arch`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[int, str]]:
    """(line, module) of every kvpolicy module that `module` imports, wherever the import statement is."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        for name in names:
            if name == "kvpolicy" or name.startswith("kvpolicy."):
                target = _resolve(name)
                assert target is not None, f"{path}:{node.lineno}: `{name}` is no module of kvpolicy"
                if target != module:
                    out.append((node.lineno, target))
    return out


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_stage():
    for module in MODULES:
        stage(module)


def _violations() -> list[str]:
    out = []
    for module, deps in GRAPH.items():
        own = stage(module)
        if own == "kernels":
            continue
        for line, dep in deps:
            theirs = stage(dep)
            where = f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({own}) imports {dep} ({theirs})"
            if theirs == "kernels":
                if own != "runtime":
                    out.append(where + ": only the runtime launches kernels")
            elif theirs == "leaf" or theirs == own:
                continue
            elif own == "leaf":
                out.append(where + ": a leaf imports nothing of kvpolicy")
            elif RANK[theirs] >= RANK[own]:
                out.append(where + (": a later stage" if RANK[theirs] > RANK[own] else ": a peer stage"))
    return out


def test_no_module_imports_a_later_stage():
    violations = _violations()
    assert not violations, "imports against the flow:\n" + "\n".join(violations)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert [c for c in _cycles() if not all(stage(m) == "kernels" for m in c)] == []


def _kernel_problems() -> list[str]:
    """Imports of kvpolicy outside the kernels, and cycles between kernels."""
    out = [f"{MODULES[m].relative_to(ROOT)}:{line}: {m} imports {dep}"
           for m, deps in GRAPH.items() if stage(m) == "kernels"
           for line, dep in deps if stage(dep) != "kernels"]
    out += ["cycle: " + " <-> ".join(c) for c in _cycles() if all(stage(m) == "kernels" for m in c)]
    return out


def test_kernels_import_only_kernels_and_no_cycles():
    assert _kernel_problems() == []


def test_the_checks_see_a_violation():
    """The checks read real edges: a planted upward import and a planted cycle are reported."""
    planted = [("kvpolicy.inputs.arch", "kvpolicy.rules.engine"), ("kvpolicy.rules.engine", "kvpolicy.inputs.arch")]
    for src, dst in planted:
        GRAPH[src].append((1, dst))
    try:
        assert any("kvpolicy.inputs.arch (inputs) imports kvpolicy.rules.engine" in v for v in _violations())
        assert any({"kvpolicy.inputs.arch", "kvpolicy.rules.engine"} <= set(c) for c in _cycles())
    finally:
        for src, _ in planted:
            GRAPH[src].pop()


def test_every_package_is_installed():
    """pyproject lists the packages (packages.find cannot follow the kernels' remap): a new stage folder must be
    listed too, or a non-editable install lacks it."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = setuptools["packages"]
    if isinstance(listed, dict):  # packages.find: every folder is found
        return
    folders = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    assert sorted(folders - set(listed)) == []


def test_every_data_folder_is_a_listed_package():
    """setuptools warns ("Package ... is absent from the `packages` configuration") and will stop shipping
    package-data files whose folder (data/, examples/starter/) is not itself a package it installs."""
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(ROOT / "pyproject.toml", expand=True)["tool"]["setuptools"]
    packages = set(config["packages"])
    absent = set()
    for package, patterns in config["package-data"].items():
        base = ROOT.joinpath(*package.split("."))
        for pattern in patterns:
            files = list(base.glob(pattern))
            assert files, f"{package}: {pattern} matches nothing"
            for f in files:
                absent.add(".".join(f.parent.relative_to(ROOT).parts))
    assert sorted(absent - packages) == []
