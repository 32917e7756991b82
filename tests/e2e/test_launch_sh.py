"""scripts/launch.sh with the built-in model: the request line it prints works (its
tokens are transformers' greedy ones on the same weights), Ctrl-C leaves no process
behind, and a server that exits stops the rest with an exit status naming it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from mpprefill.bench.procs import cmdline, free_base_port

pytest.importorskip("fastapi", reason="the HTTP fronts need the http extra")
pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 16  # the printed line's max_new_tokens
PROMPT_TEXT = "The capital of France is"  # the printed lines' prompt
CHEAP = ["--log-level", "warning", "--max-total-tokens", "1024", "--forward-mode", "normal"]


def deployment_ports(base: int, num_decodes: int) -> list[int]:
    """Every port launch.sh's header says a deployment on `--port base` takes."""
    servers = range(base, base + 2 + num_decodes)  # router, prefill, decodes
    zmq = range(base + 101, base + 102 + num_decodes)
    receivers = range(base + 202, base + 202 + num_decodes)
    return [base - 1000, base + 1 - 21002, *servers, *zmq, *receivers]


def free_base(num_decodes: int) -> int:
    """A --port whose whole deployment's ports are free now."""
    return free_base_port(p - 30000 for p in deployment_ports(30000, num_decodes))


def child_table() -> dict[int, list[int]]:
    """Each process's children, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> set[int]:
    """`pid`'s processes below it."""
    children = child_table()
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Launch:
    """scripts/launch.sh in a subprocess, its output in a file."""

    def __init__(self, *args: str):
        self.log = tempfile.NamedTemporaryFile(prefix="mpp-launch-", suffix=".log")  # noqa: SIM115
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, MPPREFILL_PYTHON=sys.executable, PYTHONPATH=path)
        cmd = ["bash", str(ROOT / "scripts" / "launch.sh"), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_line(self, start: str, timeout: float = 240.0) -> str:
        """The first printed line that starts with `start`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if line.startswith(start):
                    return line
            assert self.proc.poll() is None, self.output()[-4000:]
            time.sleep(0.3)
        raise TimeoutError(self.output()[-4000:])

    def wait_exit(self, timeout: float = 90.0) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def prompt_ids() -> list[int]:
    """The printed prompt as the built-in byte-level tokenizer encodes it."""
    from mpprefill.http.tokenizer import TextTokenizer
    from mpprefill.model import ModelConfig

    return TextTokenizer.builtin(ModelConfig.tiny().vocab_size).encode([PROMPT_TEXT])[0]


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """transformers' greedy completion of the printed prompt on the built-in model's
    weights."""
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers")
    from mpprefill.model import ModelConfig
    from mpprefill.model.export import hf_config
    from mpprefill.model.loader import hf_state_dict, load_model

    config = transformers.LlamaConfig(**hf_config(ModelConfig.tiny()))
    model = transformers.LlamaForCausalLM(config).eval().float()
    model.load_state_dict(hf_state_dict(load_model(None, seed=0)))
    prompt = prompt_ids()
    x = torch.tensor([prompt])
    with torch.no_grad():
        y = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False
        )
    return y[0, len(prompt) :].tolist()


def builtin_text(ids: list[int]) -> str:
    from mpprefill.http.tokenizer import TextTokenizer
    from mpprefill.model import ModelConfig

    return TextTokenizer.builtin(ModelConfig.tiny().vocab_size).decode(ids)


def run_line(line: str) -> dict:
    """The printed request, run as printed; its JSON reply."""
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_router_deployment_answers_the_printed_line_and_ctrl_c_stops_it(reference):
    pytest.importorskip("sglang_router", reason="needs the sglang-router package")
    base = free_base(2)
    launch = Launch("--num-decodes", "2", "--port", str(base), *CHEAP)
    try:
        line = launch.wait_line("curl ")
        assert f"http://127.0.0.1:{base}/generate" in line and '"text"' in line
        openai_line = launch.wait_line(f"{sys.executable} -c 'from openai")
        assert f'base_url="http://127.0.0.1:{base}/v1"' in openai_line
        pids = descendants(launch.proc.pid)
        assert len(pids) >= 4  # router, prefill, two decodes (and what they started)
        for _ in range(2):  # round robin: each decode once
            reply = run_line(line)
            assert reply["output_ids"] == reference, reply
            assert reply["meta_info"]["completion_tokens"] == MAX_NEW
        if importlib.util.find_spec("openai") is not None:
            done = subprocess.run(
                ["bash", "-c", openai_line], capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout.rstrip("\n") == builtin_text(reference), done.stdout
        launch.proc.send_signal(signal.SIGINT)
        assert launch.wait_exit() == 0, launch.output()[-4000:]
        assert_all_gone(pids, launch)
    finally:
        launch.close()


def test_without_the_router_the_line_does_its_part_and_a_death_stops_the_rest(reference):
    base = free_base(1)
    launch = Launch("--no-router", "--port", str(base), *CHEAP)
    try:
        line = launch.wait_line("B='")
        reply = run_line(line)
        assert reply["output_ids"] == reference, reply
        pids = descendants(launch.proc.pid)
        servers = child_table()[launch.proc.pid]  # the launcher's own children
        (decode,) = [p for p in servers if " decode " in _cmdline(p)]
        os.kill(decode, signal.SIGTERM)
        assert launch.wait_exit() == 1
        assert f"decode 1 (--port {base + 2}) exited" in launch.output()
        assert_all_gone(pids, launch)
    finally:
        launch.close()


def assert_all_gone(pids: list[int], launch: Launch) -> None:
    deadline = time.monotonic() + 10
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if running(p)], launch.output()[-4000:]


def _cmdline(pid: int) -> str:
    return cmdline(pid).replace(b"\0", b" ").decode()
