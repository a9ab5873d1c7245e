"""Hostile and broken input: every input ends in exit 0/1/2 or HTTP 2xx/4xx, fast and small,
and nothing a user wrote is overwritten.

Property tests (hypothesis, bounded examples, no deadline: the bound is asserted per example)
over CLI arguments, the policy loader and service bodies; a soak of hot reloads against a
writer that pauses half-way; and the file-safety rules of every command that writes.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy.cli import main
from kvpolicy.errors import KvPolicyError
from kvpolicy.inputs.policy_loader import read_policy
from kvpolicy.inputs.safeio import MAX_POLICY_BYTES, read_text, write_text

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 5.0
MAX_RSS_GROWTH_KB = 300 * 1024
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

POLICY = """\
version: 1
name: team
extends: builtin:default
deployments:
  - {name: chat, model: gpt-oss-20b, gpu: h100, context: 32k}
"""
PINNED = POLICY + """\
pins:
  - name: keep-bf16
    when: {fact: model.family, op: eq, value: gpt-oss}
    set: {kv_cache_dtype: auto}
"""


def _rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_cli(capsys, *argv: str) -> tuple[int, str, str, float]:
    start = time.monotonic()
    code = main(list(argv))
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    return code, out, err, took


def assert_handled(code: int, err: str, took: float, what: object) -> None:
    assert code in (0, 1, 2), f"exit {code} for {what!r}: {err[-400:]}"
    assert "internal error" not in err and "Traceback" not in err, f"{what!r}: {err[-400:]}"
    assert took < SECONDS, f"{what!r} took {took:.1f} s"


# -- CLI arguments ---------------------------------------------------------------------------

_numbers = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e309", "9" * 320, "0x10", "1_000", " 7 ", "", "32k", "1.5m",
                     "2**70", "-0", "1e-320", "０"]),
    st.text(max_size=12),
)
_models = st.sampled_from(["gpt-oss-20b", "llama-3.1-8b", "/dev/zero", "/dev/null", "/etc/passwd", "/", "",
                           "no-such-model", "../../etc", "x" * 300])
_gpus = st.sampled_from(["h100", "b200", "a100", "", "nope", "h" * 300])
_flags = ["--context", "--concurrency", "--tp", "--accuracy-floor", "--gpu-memory-utilization", "--weights-gb"]


@FUZZ
@given(model=_models, gpu=_gpus, flags=st.dictionaries(st.sampled_from(_flags), _numbers, max_size=3))
def test_cli_numbers_and_paths_are_refused_or_answered(capsys, model, gpu, flags):
    rss = _rss_kb()
    argv = ["recommend", "-m", model, "-g", gpu, "--format", "json"]
    for flag, value in flags.items():
        argv.append(f"{flag}={value}")
    code, out, err, took = run_cli(capsys, *argv)
    assert_handled(code, err, took, argv)
    if code == 0:
        decision = json.loads(out)
        assert decision["workload"]["context_tokens"] <= 16_777_216
    assert _rss_kb() - rss < MAX_RSS_GROWTH_KB


@pytest.mark.parametrize("argv", [
    ["recommend", "-m", "gpt-oss-20b", "-g", "h100", "-c", "9" * 310],
    ["recommend", "-m", "gpt-oss-20b", "-g", "h100", "--tp", str(2**70)],
    ["recommend", "-m", "gpt-oss-20b", "-g", "h100", "--weights-gb", "nan"],
    ["recommend", "-m", "gpt-oss-20b", "-g", "h100", "--accuracy-floor", "inf"],
    ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--seed", str(2**70)],
    ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--batch", "100000"],
    ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--contexts", ""],
    ["verify", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--text", "/nope"],
    ["serve", "--reload-interval", "nan"],
    ["serve", "--port", "99999"],
    ["calibrate", "-m", "llama-3.1-8b", "-g", "h100", "--num-samples", "0"],
    ["diff", "team.yaml@--output=/tmp/kvpolicy-pwned"],
    ["diff", "team.yaml", "--git-rev", "-p"],
])
def test_known_bad_arguments_exit_2(capsys, argv):
    code, _, err, took = run_cli(capsys, *argv)
    assert code == 2, err
    assert_handled(code, err, took, argv)
    assert not Path("/tmp/kvpolicy-pwned").exists()


# -- files the tool reads --------------------------------------------------------------------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def test_alias_bomb_is_refused_fast(tmp_path, capsys):
    policy = tmp_path / "bomb.yaml"
    policy.write_text("version: 1\nname: bomb\ndescription: x\n" + ALIAS_BOMB)
    assert len(policy.read_bytes()) < 700
    for command in (["lint", str(policy)], ["check", str(policy)], ["recommend", "-m", "gpt-oss-20b", "-g", "h100",
                                                                    "-p", str(policy)]):
        code, out, err, took = run_cli(capsys, *command)
        assert code == 2 and "alias" in out + err, out + err
        assert took < 2.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("where", ["policy", "extends", "model", "config"])
def test_fifos_and_devices_are_refused_without_blocking(tmp_path, capsys, where):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    policy = tmp_path / "team.yaml"
    policy.write_text(POLICY.replace("builtin:default", "pipe.yaml") if where == "extends" else POLICY)
    argv = {"policy": ["lint", str(fifo)], "extends": ["lint", str(policy)],
            "model": ["recommend", "-m", "/dev/zero", "-g", "h100"],
            "config": ["apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run", "--no-validate", "--",
                       "--config", str(fifo)]}[where]
    code, out, err, took = run_cli(capsys, *argv)
    assert code == 2 and ("FIFO" in out + err or "device" in out + err), out + err
    assert took < 2.0


def test_extends_stays_inside_the_repository(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "team").mkdir()
    secret = tmp_path / "secret.yaml"
    secret.write_text("password_key: 1\n")
    policy = repo / "team" / "p.yaml"
    policy.write_text(POLICY.replace("builtin:default", "../../secret.yaml"))
    code, out, err, _ = run_cli(capsys, "lint", str(policy))
    assert code == 2 and "outside" in out + err and "password_key" not in out + err, out + err
    (repo / "base.yaml").write_text("version: 1\nname: base\nextends: builtin:default\n")
    policy.write_text(POLICY.replace("builtin:default", "../base.yaml"))
    code, _, err, _ = run_cli(capsys, "lint", str(policy))
    assert code == 0, err
    policy.write_text(POLICY.replace("builtin:default", str(secret)))
    code, out, err, _ = run_cli(capsys, "lint", "--allow-extends-outside", str(policy))
    assert "outside" not in out + err


@pytest.mark.parametrize("text, found", [
    ('{"num_hidden_layers": 32, "num_hidden_layers": 33}', "duplicate key `num_hidden_layers`"),
    ('{"num_hidden_layers": NaN}', "NaN"),
    ('{"num_hidden_layers": 1e400}', "out of range"),
    ('{"num_hidden_layers": 1e30, "num_attention_heads": 8}', "num_hidden_layers"),
    ('{"num_hidden_layers": 100000000, "num_attention_heads": 8}', "1..4096"),
    ('{"num_hidden_layers": "32", "num_attention_heads": 8}', "num_hidden_layers"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 0, "hidden_size": 64}',
     "num_key_value_heads"),
    ("[" * 100_000 + "]" * 100_000, "nested"),
])
def test_config_json_numbers_are_bounded(tmp_path, capsys, text, found):
    config = tmp_path / "config.json"
    config.write_text(text)
    code, _, err, took = run_cli(capsys, "recommend", "-m", str(config), "-g", "h100")
    assert code == 2 and found in err, err
    assert took < SECONDS


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(),
                     st.text(max_size=8), st.sampled_from([".nan", ".inf", "1e999", "!!python/object:os.system",
                                                           "*a", "&a x", "<<", "builtin:default", "/dev/zero"]))
_yaml_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) |
                            st.dictionaries(st.sampled_from(["value", "by", "values", "when", "set", "id", "op",
                                                             "fact", "name", "context", "tp", "x"]), inner,
                                            max_size=4), max_leaves=12)
_policy_docs = st.fixed_dictionaries({}, optional={
    "version": _scalars, "name": _scalars, "extends": _scalars,
    "thresholds": st.dictionaries(st.sampled_from(["break_even_tokens", "accuracy_floor", "t"]), _yaml_values,
                                  max_size=2),
    "rules": st.lists(_yaml_values, max_size=2), "pins": st.lists(_yaml_values, max_size=2),
    "deployments": st.lists(st.fixed_dictionaries({"name": st.just("d"), "model": st.just("gpt-oss-20b"),
                                                   "gpu": st.just("h100")},
                                                  optional={"context": _scalars, "tp": _scalars,
                                                            "concurrency": _scalars, "weights_gb": _scalars}),
                            max_size=2),
    "defaults": _yaml_values, "evidence": st.lists(_yaml_values, max_size=2),
})


@FUZZ
@given(doc=_policy_docs, raw=st.one_of(st.none(), st.binary(max_size=200), st.text(max_size=200)))
def test_policy_loader_refuses_or_loads(tmp_path, capsys, doc, raw):
    path = tmp_path / "fuzz.yaml"
    if raw is None:
        path.write_text(json.dumps(doc, default=str).replace("NaN", ".nan").replace("Infinity", ".inf"))
    else:
        path.write_bytes(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"))
    rss = _rss_kb()
    for command in (["lint", str(path)], ["check", str(path)]):
        code, _, err, took = run_cli(capsys, *command)
        assert_handled(code, err, took, (command, doc, raw))
    assert _rss_kb() - rss < MAX_RSS_GROWTH_KB


def test_policy_numbers_are_finite(tmp_path):
    for bad in ("value: .nan", "value: .inf", "value: 1e999"):
        path = tmp_path / "p.yaml"
        path.write_text(f"version: 1\nname: t\nthresholds:\n  t:\n    {bad}\n")
        with pytest.raises(KvPolicyError, match="finite"):
            read_policy(path)


# -- service bodies --------------------------------------------------------------------------

starlette = pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    from kvpolicy.service.app import create_app
    from kvpolicy.service.reload import PolicyHolder

    with TestClient(create_app(PolicyHolder("builtin:default"), reload_interval_s=0),
                    raise_server_exceptions=False) as c:
        yield c


_field_values = st.one_of(_scalars, st.integers(-(10**400), 10**400), st.lists(_scalars, max_size=3),
                          st.sampled_from(["9" * 400, "1e309k", "32k", " 8 ", "\x00"]))
_bodies = st.one_of(
    st.dictionaries(st.sampled_from(["model", "gpu", "context", "priority", "concurrency", "tp", "accuracy_floor",
                                     "gpu_memory_utilization", "x"]), _field_values, max_size=6)
    .map(lambda d: json.dumps({"model": "gpt-oss-20b", "gpu": "h100", **d}, default=str).encode()),
    st.sampled_from([b'{"model": "gpt-oss-20b", "model": "x", "gpu": "h100"}', b"[" * 50_000, b'{"a": NaN}',
                     b'{"model": "gpt-oss-20b", "gpu": "h100", "context": 1e400}',
                     b'{"model": "gpt-oss-20b", "gpu": "h100", "tp": 1' + b"0" * 5000 + b"}"]),
    st.binary(max_size=100),
)


@FUZZ
@given(body=_bodies, path=st.sampled_from(["/v1/recommend", "/v1/check"]))
def test_service_bodies_get_2xx_or_4xx(client, body, path):
    start = time.monotonic()
    r = client.post(path, content=body)
    assert 200 <= r.status_code < 500, r.text
    assert time.monotonic() - start < SECONDS
    if body.startswith(b'{"model": "gpt-oss-20b", "model"'):
        assert r.status_code == 400 and "twice" in r.json()["detail"]


# -- hot reload soak -------------------------------------------------------------------------

pytest.importorskip("httpx")


def _hash(path: Path, text: str) -> str:
    path.write_text(text)
    return read_policy(path).content_hash


def test_reload_never_serves_a_half_written_file(tmp_path):
    """A writer pauses half-way through every write (shorter than the settle time): no answer
    ever comes from the half-written text, though that text is itself a valid policy."""
    import httpx

    full = PINNED + "".join(f"# padding line {i}\n" for i in range(40))
    half = POLICY + "".join(f"# padding line {i}\n" for i in range(20))  # a valid policy, and a different one
    hashes = {"a": _hash(tmp_path / "a.yaml", POLICY), "b": _hash(tmp_path / "b.yaml", full),
              "half": _hash(tmp_path / "h.yaml", half)}
    assert len(set(hashes.values())) == 3
    policy = tmp_path / "team.yaml"
    policy.write_text(POLICY)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvpolicy", "serve", "--policy", str(policy), "--port", "0",
                             "--reload-interval", "0.05", "--reload-settle", "0.4"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = None
        deadline = time.monotonic() + 30
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            text = (tmp_path / "serve.log").read_text()
            if " on http://" in text:
                url = text.split(" on ", 1)[1].split()[0]
            time.sleep(0.05)
        seen: set[str] = set()
        stop = threading.Event()

        def clients() -> None:
            with httpx.Client(base_url=url, timeout=10) as c:
                while not stop.is_set():
                    r = c.post("/v1/recommend", json={"model": "gpt-oss-20b", "gpu": "h100"})
                    assert r.status_code == 200
                    seen.add(r.headers["x-kvpolicy-policy"])

        reader = threading.Thread(target=clients)
        reader.start()
        for target in (full, POLICY, full, POLICY, full):
            with policy.open("w") as f:  # not atomic on purpose: truncate, half, pause, rest
                f.write(half if target == full else target[: len(target) // 2])
                f.flush()
                time.sleep(0.15)
                if target == full:
                    f.seek(0)
                    f.write(full)
                else:
                    f.write(target[len(target) // 2:])
            time.sleep(0.9)
        stop.set()
        reader.join()
        assert hashes["half"] not in seen and seen <= {hashes["a"], hashes["b"]}, (seen, hashes)
        assert hashes["b"] in seen
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_slow_clients_are_cut_off(tmp_path):
    """Half-sent headers are closed after --header-timeout; a body slower than --body-timeout gets 408."""
    import re
    import socket

    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpolicy", "serve", "--port", "0", "--reload-interval", "0",
                                 "--header-timeout", "0.5", "--body-timeout", "0.5"], stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while "Application startup complete" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        port = int(re.search(r"127\.0\.0\.1:(\d+)", log.read_text()).group(1))
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for s in slow:
            s.sendall(b"POST /v1/recommend HTTP/1.1\r\nHost: x\r\n")
        body = socket.create_connection(("127.0.0.1", port))
        body.sendall(b"POST /v1/recommend HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(1.5)
        for s in slow:
            s.settimeout(2)
            assert s.recv(10) == b""  # closed by the server
        body.settimeout(2)
        assert body.recv(40).startswith(b"HTTP/1.1 408")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- files the tool writes -------------------------------------------------------------------


@pytest.fixture
def no_vllm(monkeypatch):
    from kvpolicy.outputs import vllm_launch

    monkeypatch.setattr(vllm_launch, "find_vllm", lambda python=None: None)


WRITERS = {
    "apply": lambda target: ["apply", "-m", "gpt-oss-20b", "-g", "h100", "--no-validate", "--emit-config", target],
    "calibrate": lambda target: ["calibrate", "-m", "llama-3.1-8b", "-g", "h100", "--strategy", "tensor",
                                 "--emit-recipe", target],
}


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_writers_refuse_existing_files_and_symlinks(tmp_path, capsys, no_vllm, command):
    target = tmp_path / "out.yaml"
    target.write_text("mine\n")
    code, _, err, _ = run_cli(capsys, *WRITERS[command](str(target)))
    assert code == 2 and "already exists" in err and target.read_text() == "mine\n", err
    code, _, err, _ = run_cli(capsys, *WRITERS[command](str(target)), "--force")
    assert code == 0 and target.read_text() != "mine\n", err
    precious = tmp_path / "precious.txt"
    precious.write_text("keep\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(precious)
    code, _, err, _ = run_cli(capsys, *WRITERS[command](str(link)), "--force")
    assert code == 2 and "symbolic link" in err and precious.read_text() == "keep\n" and link.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_schema_refreshes_its_own_files_only(tmp_path, capsys):
    out = tmp_path / "schemas"
    code, _, err, _ = run_cli(capsys, "schema", "--out", str(out))
    assert code == 0, err
    code, _, err, _ = run_cli(capsys, "schema", "--out", str(out))  # its own files: refreshed
    assert code == 0, err
    (out / "policy.schema.json").write_text('{"mine": true}\n')
    code, _, err, _ = run_cli(capsys, "schema", "--out", str(out))
    assert code == 2 and "--force" in err and json.loads((out / "policy.schema.json").read_text()) == {"mine": True}
    code, _, err, _ = run_cli(capsys, "schema", "--out", str(out / "policy.schema.json"))
    assert code == 2 and "is a file" in err


def test_schema_check_tells_missing_from_stale(tmp_path, capsys):
    out = tmp_path / "schemas"
    code, _, err, _ = run_cli(capsys, "schema", "--check", "--out", str(out))
    assert code == 1 and "missing JSON Schema: " in err and "stale" not in err
    assert f"Run `kvpolicy schema --out {out}`" in err
    assert run_cli(capsys, "schema", "--out", str(out))[0] == 0
    assert run_cli(capsys, "schema", "--check", "--out", str(out))[0] == 0
    (out / "plan.schema.json").unlink()
    (out / "policy.schema.json").write_text("{}\n")
    code, _, err, _ = run_cli(capsys, "schema", "--check", "--out", str(out))
    assert code == 1
    assert f"missing JSON Schema: {out / 'plan.schema.json'}; stale JSON Schema (differs from the code): " \
           f"{out / 'policy.schema.json'}." in err


def test_init_and_record_never_replace_a_symlink(tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep\n")
    (tmp_path / "kvpolicy_test.yaml").symlink_to(precious)
    code, _, err, _ = run_cli(capsys, "init", "--dir", str(tmp_path), "--force")
    assert code == 2 and "symbolic link" in err
    assert precious.read_text() == "keep\n" and not (tmp_path / "kvpolicy.yaml").exists()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code, _, err, _ = run_cli(capsys, "init", "--dir", str(fresh), "--name", 'x"\nextends: /etc/passwd')
    assert code == 2 and "one line" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_refused_before_the_run(tmp_path, capsys, no_vllm):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        code, _, err, _ = run_cli(capsys, *WRITERS["apply"](str(folder / "x.yaml")))
        assert code == 2 and "not writable" in err, err
    finally:
        folder.chmod(stat.S_IRWXU)


_FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
from kvpolicy.inputs.safeio import write_text
from kvpolicy.errors import InputError
try:
    write_text(sys.argv[1], "x" * 100_000, force=True)
except InputError as exc:
    print(exc)
    sys.exit(2)
"""


def test_a_full_disk_leaves_the_old_file(tmp_path):
    """The write fails part-way (a tmpfs of a few KB where one can be mounted, else a file-size limit):
    the target keeps its old content and no temp file is left behind."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(folder)], capture_output=True).returncode == 0
    try:
        target = folder / "team.yaml"
        target.write_text("old\n")
        proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(target)], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        assert proc.returncode == 2 and "Nothing was changed" in proc.stdout, proc.stdout + proc.stderr
        assert target.read_text() == "old\n"
        assert [p.name for p in folder.iterdir()] == ["team.yaml"]
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=False)


def test_reader_and_writer_basics(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_POLICY_BYTES + 1))
    with pytest.raises(KvPolicyError, match="limit"):
        read_text(big)
    target = tmp_path / "t.txt"
    write_text(target, "a\n")
    with pytest.raises(KvPolicyError, match="already exists"):
        write_text(target, "b\n")
    write_text(target, "b\n", force=True)
    assert target.read_text() == "b\n"
