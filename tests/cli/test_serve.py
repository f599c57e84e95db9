"""`moe-tune serve` on a real auto-tune result: it answers /v1/chat/completions through the URL it prints, Ctrl-C
and SIGTERM leave no llama.cpp process, a changed model or engine is named before anything starts (with the
re-tune command), a busy port is one line, and the network needs a key or gets a warning."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli
from tests.demo_result import tune_demo, variant
from tuner.cli import cmd_serve
from tuner.cli.docs import help_text
from tuner.report import study_report

EXE = Path(sys.executable).parent / "moe-tune"
READY_S = 120


@pytest.fixture(scope="module")
def tuned(engine_loc, tmp_path_factory) -> Path:
    return tune_demo(engine_loc, tmp_path_factory.mktemp("tuned"))


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([str(EXE), "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"COLUMNS": "200"} | (env or {}))


def ready(proc: subprocess.Popen[str]) -> tuple[str, int, str]:
    """What serve says until the server is healthy: the base URL it prints (stdout's one line), the server's pid
    and the lines before it (stderr)."""
    assert proc.stdout is not None and proc.stderr is not None
    said: list[str] = []
    while not (said and "is ready" in said[-1]):
        line = proc.stderr.readline()
        assert line, "".join(said)
        said.append(line)
    pid = re.search(r"llama-server \(pid (\d+)\) is ready", said[-1])
    url = re.search(r"OpenAI-compatible base URL: (http://\S+/v1)$", proc.stdout.readline().strip())
    assert pid and url, said
    return url.group(1), int(pid.group(1)), "".join(said)


def model_ids(url: str, key: str | None = None) -> list[str]:
    """What /v1/models lists: the names an OpenAI client and a UI show."""
    req = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def post(url: str, payload: dict, key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        body: dict = json.loads(resp.read())
        return body


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A port something listens on: serve stops there, so a check that wrongly lets the line through ends the
    command instead of leaving a server running."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_answers_chat_completions_and_stops_cleanly(tuned, stop):
    proc = start(str(tuned.parent), "--", "--alias", "demo-alias")
    try:
        url, pid, said = ready(proc)
        reply = post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                 "max_tokens": 8})
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["model"] == "demo-alias"  # the passed-through flag reached the server
    finally:
        proc.send_signal(stop)
        _, rest = proc.communicate(timeout=30)
    assert proc.returncode == 0, said + rest
    assert "not measured, passed through: --alias demo-alias" in said
    assert rest.strip() == "llama-server stopped"
    assert gone(pid)


def argv_holding(secret: str) -> list[str]:
    """Every process on this machine whose command line holds ``secret`` (what any local user reads in /proc)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        words = proc.info["cmdline"] or []
        if any(secret in w for w in words):
            found.append(f"{proc.info['pid']}: {shlex.join(words)}")
    return found


def test_on_the_network_the_key_is_required_and_in_no_argv(tuned, tmp_path):
    key_file = tmp_path / "keys" / "api-key"
    key_file.parent.mkdir()
    proc = start(str(tuned), "--host", "0.0.0.0", "--api-key-file", str(key_file), "--alias", "team-model",
                 env={"LLAMA_API_KEY": "sesame-from-the-shell"})
    try:
        url, pid, said = ready(proc)
        key = key_file.read_text().strip()  # serve made it: a new random key, the user's alone
        assert re.fullmatch(r"[0-9a-f]{32}", key) and key_file.stat().st_mode & 0o777 == 0o600
        assert f"a new key was written to {key_file}: clients send `Authorization: Bearer KEY`" in said
        assert argv_holding(key) == []  # neither serve's nor llama-server's nor any other command line
        assert str(key_file) not in " ".join(psutil.Process(pid).cmdline())  # the file goes by environment too
        assert url.startswith("http://127.0.0.1:")  # a wildcard address is reached on loopback from here
        ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(f"{url}/chat/completions", ask)
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as exported:  # an exported key is not a second key beside it
            post(f"{url}/chat/completions", ask, key="sesame-from-the-shell")
        assert exported.value.code == 401
        assert post(f"{url}/chat/completions", ask, key=key)["model"] == "team-model"
        assert model_ids(url, key) == ["team-model"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert "without a key" not in said and gone(pid)


def test_a_key_from_the_environment_stays_out_of_every_argv(tuned):
    secret = "sesame-" + os.urandom(8).hex()
    proc = start(str(tuned), "--host", "0.0.0.0", env={"LLAMA_API_KEY": secret})
    try:
        url, pid, said = ready(proc)
        assert argv_holding(secret) == []
        assert "the key is in $LLAMA_API_KEY" in said
        # No --alias: the model file's name without .gguf, never its absolute path (the home folder in it).
        stem = Path(json.loads(tuned.read_text())["model"]).stem
        assert model_ids(url, secret) == [stem] and f"served as model '{stem}'" in said
        assert post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                    key=secret)["model"] == stem
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert gone(pid)


def test_a_key_on_the_command_line_is_refused_in_one_line(tuned, tmp_path):
    for args in (["--api-key", "sesame"], ["--", "--api-key", "sesame"], ["--", "--api-key=sesame"]):
        res = run_cli("serve", str(tuned), *args)
        assert res.returncode == 1 and "Traceback" not in res.stderr and "llama-server (pid" not in res.stderr
        assert res.stderr.strip().splitlines()[-1] == (
            "error: a key on the command line is readable by every local user (/proc/PID/cmdline): export "
            "LLAMA_API_KEY, or give --api-key-file FILE (made with a new key when it does not exist)")
    empty = tmp_path / "empty-key"
    empty.write_text("# no key yet\n")
    empty.chmod(0o600)  # the user's alone: else refused before it is read
    res = run_cli("serve", str(tuned), "--api-key-file", str(empty))
    assert res.returncode == 1 and f"error: --api-key-file {empty} holds no key" in res.stderr
    empty.write_text("sesame\n")
    empty.chmod(0o644)  # readable by every local user: refused before llama-server starts
    res = run_cli("serve", str(tuned), "--host", "0.0.0.0", "--api-key-file", str(empty))
    assert res.returncode == 1 and "Traceback" not in res.stderr and "llama-server (pid" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (f"error: --api-key-file {empty} can be read or written by others "
                                                   f"(mode 644): run `chmod 600 {empty}`")


def test_a_busy_port_is_one_line_and_the_open_network_is_warned(tuned):
    with busy_port() as port:
        res = run_cli("serve", str(tuned), "--port", str(port), env={"LLAMA_API_KEY": ""})
        assert res.returncode == 1 and "Traceback" not in res.stderr
        [error] = [x for x in res.stderr.splitlines() if x.startswith("error:")]
        assert error == (f"error: port {port} on 127.0.0.1 is in use: pick another --port, or leave it out for a "
                         "free one")
        assert res.stderr.strip().endswith(error)
        wide = run_cli("serve", str(tuned), "--host", "0.0.0.0", "--port", str(port), env={"LLAMA_API_KEY": ""})
    assert wide.returncode == 1 and "is in use" in wide.stderr  # (a wildcard address cannot take it either)
    assert ("warning: listening on 0.0.0.0 without a key (--api-key-file or LLAMA_API_KEY): anyone who can reach "
            "this machine can use the server") in wide.stderr
    taken_flag = run_cli("serve", str(tuned), "--", "--port", "9")
    assert taken_flag.returncode == 1 and "--port after -- would move the server" in taken_flag.stderr


def test_a_changed_model_file_or_engine_is_named_before_starting(tuned, tmp_path):
    model = tmp_path / "copy" / "demo.gguf"
    model.parent.mkdir()
    data = bytearray(Path(json.loads(tuned.read_text())["model"]).read_bytes())
    model.write_bytes(data)
    moved = variant(tuned, tmp_path / "results" / "moved", model=model)
    # The same bytes written again later (a copy, a re-download): the line holds, and serve says why.
    later = moved.stat().st_mtime + 120
    os.utime(model, (later, later))
    with busy_port() as port:
        same = run_cli("serve", str(moved.parent), "--port", str(port))
    assert "is in use" in same.stderr and "its contents are the tuned file's" in same.stderr, same.stderr
    # Other weights under an older modification time: the time alone would have passed it.
    data[-64] ^= 0xFF
    model.write_bytes(data)
    earlier = moved.stat().st_mtime - 120
    os.utime(model, (earlier, earlier))
    with busy_port() as port:
        res = run_cli("serve", str(moved.parent), "--port", str(port))
    assert res.returncode == 1 and "Traceback" not in res.stderr and "is in use" not in res.stderr
    assert f"the model file {model} is not the file that was tuned: its last tensor data differs" in res.stderr
    retune = re.search(r"Re-tune with `([^`]+)`", res.stderr)
    assert retune and shlex.split(retune.group(1))[:3] == ["moe-tune", "auto-tune", str(model)]
    assert "llama-server (pid" not in res.stderr and "--force" in res.stderr

    old_engine = variant(tuned, tmp_path / "results" / "engine",
                         lambda d: d.update(engine={**d["engine"], "commit": "0000000"}))
    with busy_port() as port:
        res = run_cli("serve", str(old_engine), "--port", str(port))
    assert res.returncode == 1 and "is in use" not in res.stderr
    assert "the line was measured on llama.cpp 0000000 (cpu)" in res.stderr and "moe-tune auto-tune" in res.stderr


def test_serve_finds_the_newest_result_of_a_model(tuned, tmp_path):
    """A model path picks its newest result in --results-dir; a result folder without result.json is refused."""
    model = json.loads(tuned.read_text())["model"]
    with busy_port() as port:  # stops it before anything starts: the lookup and the check are what is tested
        res = run_cli("serve", model, "--results-dir", str(tuned.parent.parent), "--port", str(port))
    assert f"of {tuned}" in res.stderr and "is in use" in res.stderr
    none = run_cli("serve", model, "--results-dir", str(tmp_path))
    assert none.returncode == 1 and "no tuned result for" in none.stderr and "moe-tune auto-tune" in none.stderr
    empty = run_cli("serve", str(tmp_path))
    assert empty.returncode == 1 and "holds no result.json" in empty.stderr


def test_the_retune_command_is_a_real_auto_tune_line(tuned):
    line = cmd_serve.retune_command(study_report.load_result(tuned))
    argv = shlex.split(line)
    model = json.loads(tuned.read_text())["model"]
    assert argv == ["moe-tune", "auto-tune", model, "--workload", "chat", "--n-prompt", "16", "--n-gen", "16",
                    "--min-ctx", "512", "--max-kld", "off"]
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text("auto-tune")))
    assert {a for a in argv if a.startswith("--")} <= options


def test_a_model_path_that_cannot_be_read_is_one_line(tuned, tmp_path):
    """A directory where the tuned model was, and (for a user other than root, whom chmod 000 does not stop) a
    file nobody may read: each is one line naming the file, before anything starts."""
    folder = tmp_path / "demo.gguf"
    folder.mkdir()
    cases = {variant(tuned, tmp_path / "results" / "dir", model=folder): f"the model file {folder} is a directory now"}
    if os.geteuid() != 0:
        locked = tmp_path / "locked.gguf"
        locked.write_bytes(Path(json.loads(tuned.read_text())["model"]).read_bytes())
        locked.chmod(0)
        cases[variant(tuned, tmp_path / "results" / "locked", model=locked)] = (
            f"the model file {locked} cannot be read (Permission denied)")
    for result, said in cases.items():
        res = run_cli("serve", str(result.parent))
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        [error] = [x for x in res.stderr.splitlines() if x.startswith("error:")]
        assert error.startswith(f"error: the line may no longer hold: {said}"), error
        assert "llama-server (pid" not in res.stderr
