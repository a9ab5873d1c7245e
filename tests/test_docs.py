"""What README and the install scripts tell a new user to run: it must work off this machine."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def test_cpu_torch_comes_from_the_cpu_index():
    """`pip install torch==X` from the default index installs the CUDA build."""
    for name, text in (("README.md", README), (".ci/run", (ROOT / ".ci" / "run").read_text()),
                       ("setup-vllm-venv.sh", (ROOT / "tests/fixtures/e2e/setup-vllm-venv.sh").read_text())):
        lines = [line for line in text.splitlines() if re.search(r"pip install (-q )?torch==", line)]
        assert lines, f"{name} no longer installs torch"
        assert all(CPU_INDEX in line for line in lines), f"{name}: {lines}"


def test_no_install_from_pypi_where_kvpolicy_is_not_published():
    """kvpolicy is not on PyPI: `pip install kvpolicy` and `kvpolicy[extra]` do not resolve."""
    sources = {"README.md": README, ".pre-commit-hooks.yaml": (ROOT / ".pre-commit-hooks.yaml").read_text()}
    sources |= {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in (ROOT / "kvpolicy").rglob("*.py")}
    bare = re.compile(r"""pip install (-\w+ )*["']?kvpolicy(?! @)(\[|["'`\s]|$)""", re.M)
    found = [f"{name}: {m.group(0)}" for name, text in sources.items() for m in bare.finditer(text)]
    assert not found, found


def test_release_tags_in_readme_are_this_version():
    """The git URL and pre-commit's `rev:` name the tag `v` + pyproject's version (how releases are tagged)."""
    tags = re.findall(r"kvpolicy@(v[\w.]+)", README) + re.findall(r"^\s*rev: (\S+)", README, re.M)
    hooks = (ROOT / ".pre-commit-hooks.yaml").read_text()
    tags += re.findall(r"rev: (\S+)", hooks)
    assert len(tags) >= 3 and set(tags) == {f"v{VERSION}"}, tags
