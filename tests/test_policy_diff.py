"""`kvpolicy diff`: two files, a file at a git revision, the reasons, and the errors outside a repo."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.policy.diff import split_revision

ROOT = Path(__file__).resolve().parent.parent
TEAM = (ROOT / "policies" / "examples" / "team" / "kvpolicy.yaml").read_text()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("old.yaml").write_text(TEAM)
    # A PR that turns the short-context rule back on and shortens the batch context.
    new = TEAM.replace("disable: [KV106]", "disable: []").replace("    context: 8k\n", "    context: 4k\n")
    new = new.replace("    priority: balanced\n    concurrency: 64\n", "    priority: decode\n    concurrency: 64\n")
    Path("new.yaml").write_text(new)
    return tmp_path


def test_two_files_show_what_changes_and_why(pair, capsys):
    code, out, _ = run_cli(capsys, "diff", "old.yaml", "new.yaml")
    assert code == 0
    assert "~ rule KV106 enabled" in out
    assert "CHANGED batch-summarize" in out
    assert "kv_cache_dtype: fp8 -> auto (INF101 -> KV106: workload.context_tokens (4096) <" in out
    assert "deployment context: 8k -> 4k" in out and "deployment priority: balanced -> decode" in out
    assert "same    chat-llama-8b" in out
    assert "5 deployments, 1 decision changed" in out


def test_exit_code_json_and_github(pair, capsys):
    assert run_cli(capsys, "diff", "old.yaml", "old.yaml", "--exit-code")[0] == 0
    code, out, _ = run_cli(capsys, "diff", "old.yaml", "new.yaml", "--exit-code", "--format", "json")
    assert code == 1
    data = json.loads(out)
    changed = [d for d in data["deployments"] if d["status"] == "changed"]
    assert [d["name"] for d in changed] == ["batch-summarize"]
    assert changed[0]["changes"][0] == {"field": "kv_cache_dtype", "old": "fp8", "new": "auto", "old_by": "INF101",
                                        "new_by": "KV106", "reason": changed[0]["changes"][0]["reason"]}
    code, out, _ = run_cli(capsys, "diff", "old.yaml", "new.yaml", "--format", "github")
    line = next(i + 1 for i, text in enumerate(Path("new.yaml").read_text().splitlines())
                if "name: batch-summarize" in text)
    assert out.startswith(f"::warning file=new.yaml,line={line},col=5,title=kvpolicy diff::deployment batch-summarize")


def test_ad_hoc_inputs_compare_a_model_under_both_policies(pair, capsys):
    code, out, _ = run_cli(capsys, "diff", "old.yaml", "new.yaml", "-m", "qwen3-8b", "-g", "h100", "-c", "4k")
    assert code == 0 and "qwen3-8b on h100" in out
    # A count in --gpu is the tensor-parallel size, as for recommend.
    code, out, _ = run_cli(capsys, "diff", "old.yaml", "new.yaml", "-m", "llama-3.3-70b", "-g", "2xh100", "-f", "json")
    pair = next(d for d in json.loads(out)["deployments"] if d["name"] == "llama-3.3-70b on 2xh100")
    # At tp 1 the 70B weights leave no room for a cache (BF16, KV100); at tp 2 FP8 holds two requests.
    assert code == 0 and pair["status"] == "unchanged" and pair["new_decision"]["kv_cache_dtype"] == "fp8"
    assert pair["new_concurrency"] > 1


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_revisions(pair, capsys):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args], check=True,
                       capture_output=True)

    git("init", "-q", ".")
    Path("sub").mkdir()
    shutil.copy("old.yaml", "sub/team.yaml")
    git("add", "sub/team.yaml")
    git("commit", "-qm", "policy")
    shutil.copy("new.yaml", "sub/team.yaml")
    code, out, _ = run_cli(capsys, "diff", "sub/team.yaml", "--git-rev", "HEAD")
    assert code == 0 and "policy: sub/team.yaml@HEAD -> sub/team.yaml" in out and "CHANGED batch-summarize" in out
    assert run_cli(capsys, "diff", "sub/team.yaml@HEAD", "--exit-code")[0] == 1
    git("commit", "-qam", "second")
    code, out, _ = run_cli(capsys, "diff", "sub/team.yaml@HEAD~1", "sub/team.yaml@HEAD", "--exit-code")
    assert code == 1 and "policy: sub/team.yaml@HEAD~1 -> sub/team.yaml@HEAD" in out
    code, _, err = run_cli(capsys, "diff", "sub/team.yaml@HEAD~5")
    assert code == 2 and "unknown git revision `HEAD~5`" in err
    code, _, err = run_cli(capsys, "diff", "new.yaml@HEAD")
    assert code == 2 and "new.yaml does not exist at revision HEAD" in err


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_revision_outside_a_repository(pair, capsys, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(pair.parent))
    code, out, err = run_cli(capsys, "diff", "old.yaml@HEAD")
    assert code == 2 and "not inside a git repository" in err and "kvpolicy diff OLD.yaml NEW.yaml" in err
    assert "Traceback" not in out + err


def test_usage_errors(pair, capsys):
    code, _, err = run_cli(capsys, "diff", "old.yaml")
    assert code == 2 and "give two policies" in err
    code, _, err = run_cli(capsys, "diff", "old.yaml", "new.yaml", "--git-rev", "HEAD")
    assert code == 2 and "--git-rev compares one file" in err
    code, _, err = run_cli(capsys, "diff", "old.yaml", "missing.yaml")
    assert code == 2 and "missing.yaml: file not found" in err


def test_split_revision():
    assert split_revision("team.yaml@HEAD~1") == ("team.yaml", "HEAD~1")
    assert split_revision("a/b@c/team.yaml@origin/main") == ("a/b@c/team.yaml", "origin/main")
    assert split_revision("team.yaml") == ("team.yaml", None)
