"""The set-up scripts, run against a copy of scripts/ whose .venv and OS tools are stubs
that log their arguments: what reaches pip, `mpprefill bench`, pytest and apt-get."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
RDMA_LIBS = "libibverbs1 librdmacm1 libnuma1"

# A .venv python that has torch and every optional package; `ctypes.CDLL(...)` (the RDMA
# library probe) exits $CDLL_RC.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$LOG"
case "$*" in *CDLL*) exit "${CDLL_RC:-0}" ;; esac
exit 0
"""
LOGGING_TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$LOG"
exit "${TOOL_RC:-0}"
"""

# What test.sh runs by default: two workers, each file on one of them.
PYTEST = "python -m pytest -n 2 --dist loadfile"


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A project root with the real scripts, a stub .venv and stub `id` / `apt-get`."""
    root = tmp_path / "root"
    shutil.copytree(SCRIPTS, root / "scripts", ignore=shutil.ignore_patterns("*.py", "chaoslib"))
    (root / "pyproject.toml").write_text("")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _exe(venv_bin / "python", FAKE_PYTHON)
    _exe(venv_bin / "mpprefill", LOGGING_TOOL)
    tools = tmp_path / "tools"
    tools.mkdir()
    _exe(tools / "apt-get", LOGGING_TOOL)
    return root


def run_script(root: Path, script: str, *args: str, uid: int = 0, **env: str) -> list[str]:
    """Run scripts/<script> with `id -u` answering `uid`; the stubs' log lines."""
    log = root.parent / "log"
    _exe(root.parent / "tools" / "id", f"#!/bin/sh\necho {uid}\n")
    path = f"{root.parent / 'tools'}:/usr/bin:/bin"
    env = {"PATH": path, "LOG": str(log), "HOME": str(root.parent), **env}
    done = subprocess.run(
        ["bash", str(root / "scripts" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_run_sh_passes_its_flags_to_bench_not_to_pip(tree):
    lines = run_script(tree, "run.sh", "--json", "out.json", "--repeats", "3")
    installs = [ln for ln in lines if " pip install " in ln]
    assert installs and all(ln.endswith("-e .") for ln in installs), installs
    assert lines[-1] == "mpprefill bench --json out.json --repeats 3"


def test_test_sh_installs_extras_then_runs_pytest_with_its_args(tree):
    lines = run_script(tree, "test.sh", "-q", "tests/ipc")
    assert any(ln.endswith("-e .[test,hf,plot,http]") for ln in lines), lines
    assert lines[-1] == f"{PYTEST} -q tests/ipc"


def test_test_sh_runs_one_pytest_worker_when_asked(tree):
    lines = run_script(tree, "test.sh", "-x", MPPREFILL_TEST_WORKERS="0")
    assert lines[-1] == "python -m pytest -n 0 --dist loadfile -x"


def test_missing_rdma_libraries_are_installed_as_root(tree):
    lines = run_script(tree, "test.sh", CDLL_RC="1")
    assert "apt-get update -qq" in lines
    assert f"apt-get install -y -qq {RDMA_LIBS}" in lines
    assert lines[-1] == PYTEST


@pytest.mark.parametrize(
    "case, uid, env",
    [
        ("present", 0, {"CDLL_RC": "0"}),
        ("not root", 1000, {"CDLL_RC": "1"}),
    ],
)
def test_rdma_libraries_left_alone(tree, case, uid, env):
    lines = run_script(tree, "test.sh", uid=uid, **env)
    assert not [ln for ln in lines if ln.startswith("apt-get")], case
    assert lines[-1] == PYTEST


def test_failed_rdma_install_does_not_stop_the_tests(tree):
    lines = run_script(tree, "test.sh", CDLL_RC="1", TOOL_RC="100")
    assert "apt-get update -qq" in lines
    assert lines[-1] == PYTEST


# launch.sh's stub python: `import sglang_router` fails with $NO_ROUTER set; a server
# (`-m ...`) logs its command line and runs until stopped; a health check logs and passes.
LAUNCH_PYTHON = """#!/usr/bin/env bash
case "$*" in *"import sglang_router"*) [ -z "${NO_ROUTER:-}" ] || exit 1 ;; esac
echo "python $*" >> "$LOG"
case "$*" in "-m pip"*) ;; "-m "*) exec sleep 60 ;; esac
exit 0
"""


class Launched(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    started: list[str]  # the servers' command lines, sorted (they log as they start)


def run_launch(root: Path, *args: str, servers: int = 0, **env: str) -> Launched:
    """launch.sh against stub servers; once `servers` of them run, SIGTERM to it."""
    _exe(root / ".venv" / "bin" / "python", LAUNCH_PYTHON)
    log, out, err = (root.parent / name for name in ("log", "out", "err"))
    path = f"{root.parent / 'tools'}:/usr/bin:/bin"
    env = {"PATH": path, "LOG": str(log), "HOME": str(root.parent), **env}
    cmd = ["bash", str(root / "scripts" / "launch.sh"), *args]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(cmd, env=env, stdout=o, stderr=e, text=True)
    try:
        deadline = time.monotonic() + 30
        while servers and len(_servers(log)) < servers and time.monotonic() < deadline:
            time.sleep(0.05)
        while servers and not out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        if servers:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Launched(proc.returncode, out.read_text(), err.read_text(), sorted(_servers(log)))


def _servers(log: Path) -> list[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [ln for ln in lines if ln.startswith("python -m ") and " pip " not in ln]


def test_launch_sh_ports_derive_from_port_and_shared_flags_reach_the_decodes(tree):
    argv = ["--num-decodes", "2", "--port", "40000", "--model-path", "/m", "--page-size"]
    argv += ["32", "--chunked-prefill-size", "256", "--log-level=warning"]
    done = run_launch(tree, *argv, servers=4)
    shared = "--model-path /m --page-size 32 --log-level warning --host 127.0.0.1"
    decode = f"python -m mpprefill decode {shared} --port"
    assert done.started == sorted(
        [
            f"{decode} 40002 --disaggregation-transfer-backend shm",
            f"{decode} 40003 --disaggregation-transfer-backend shm",
            f"python -m mpprefill serve {shared} --port 40001 --disaggregation-transfer-backend shm"
            " --disaggregation-bootstrap-port 18999 --chunked-prefill-size 256",
            "python -m sglang_router.launch_router --pd-disaggregation"
            " --prefill http://127.0.0.1:40001 18999 --decode http://127.0.0.1:40002"
            " --decode http://127.0.0.1:40003 --host 127.0.0.1 --port 40000"
            " --prometheus-port 39000 --policy round_robin --log-level warn"
            " --disable-retries --disable-circuit-breaker --health-check-interval-secs 1"
            " --health-failure-threshold 2 --health-success-threshold 1",
        ]
    )
    curl, openai = done.stdout.splitlines()
    assert curl.startswith("curl -s http://127.0.0.1:40000/generate ")
    assert '"text": "The capital of France is"' in curl  # a --model-path has a tokenizer
    assert 'base_url="http://127.0.0.1:40000/v1"' in openai
    assert done.returncode == 0 and "[launch] stopping" in done.stderr  # SIGTERM


def test_launch_sh_without_the_router_says_how_to_install_it(tree):
    done = run_launch(tree, "--port", "40000", servers=2, NO_ROUTER="1")
    assert "pip install sglang-router" in done.stderr
    assert not [ln for ln in done.started if "sglang_router" in ln]
    ports = [ln.split(" --port ")[1].split()[0] for ln in done.started]
    assert ports == ["40002", "40001"]  # decode, serve
    (line,) = done.stdout.splitlines()
    assert '"text": ' in line  # the built-in model has its byte-level tokenizer
    assert '"bootstrap_port": 18999' in line and "127.0.0.1:40002/generate" in line


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--num-decodes", "0"], "--num-decodes must be 1..98"),
        (["--port", "20000"], "derives no bootstrap port"),
        (["--port"], "--port needs a value"),
    ],
)
def test_launch_sh_refuses_bad_launcher_flags(tree, argv, why):
    done = run_launch(tree, *argv)
    assert done.returncode == 2 and why in done.stderr and done.started == []


def test_launch_sh_api_key_reaches_the_router_by_flag_and_the_servers_by_environment(tree):
    done = run_launch(tree, "--port", "40000", "--api-key", "s3cret", servers=3)
    servers = [ln for ln in done.started if "sglang_router" not in ln]
    (router,) = [ln for ln in done.started if "sglang_router" in ln]
    assert len(servers) == 2 and not [ln for ln in servers if "s3cret" in ln]
    assert router.endswith(" --api-key s3cret")
    curl, openai = done.stdout.splitlines()
    assert '-H "Authorization: Bearer $MPPREFILL_API_KEY"' in curl
    assert 'api_key=__import__("os").environ["MPPREFILL_API_KEY"]' in openai


def test_launch_sh_refuses_an_empty_api_key(tree):
    done = run_launch(tree, "--api-key", "")
    assert done.returncode == 2 and "--api-key must not be empty" in done.stderr
