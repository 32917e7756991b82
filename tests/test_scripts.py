"""The set-up scripts, run against a copy of scripts/ whose .venv and OS tools are stubs
that log their arguments: what reaches pip, `mpprefill bench`, pytest and apt-get."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

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
