"""/start_profile and /stop_profile on a proc-ahead serve: both processes' spans merged in
one Chrome trace, torch's trace of the forward process, and a num_steps profile that stops
by itself."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.http.test_serve_front import ServeWithFront  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def serve():
    s = ServeWithFront.start("--forward-mode", "proc-ahead", "--worker-threads", "1")
    yield s
    s.kill()


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _load_requests(serve, n: int = 4) -> None:
    for i in range(n):
        status, out = serve.post("/generate", {"input_ids": [3 + i] * 40})
        assert status == 200, out


def test_start_and_stop_write_both_traces(serve, tmp_path):
    out_dir = tmp_path / "prof"
    status, out = serve.post("/start_profile", {"output_dir": str(out_dir)})
    assert status == 200 and out["success"], out
    status, again = serve.post("/start_profile", {"output_dir": str(out_dir)})
    assert status == 400 and "already" in again["message"]
    _load_requests(serve)
    status, out = serve.post("/stop_profile", {})
    assert status == 200 and out["success"], out
    merged, torch_trace = out["files"]
    events = _load(merged)["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"scheduler", "worker"}
    spans = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"forward", "build", "process"} <= spans, (
        spans
    )  # the forward (worker) and the scheduler's phases
    assert "torch.worker." in torch_trace
    torch_events = _load(torch_trace)["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in torch_events)
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        [merged.rsplit("/", 1)[1], torch_trace.rsplit("/", 1)[1]]
    )  # the per-process dumps were merged away
    status, out = serve.post("/stop_profile", {})
    assert status == 400 and out["message"] == "not profiling"


def test_a_num_steps_profile_stops_by_itself(serve, tmp_path):
    out_dir = tmp_path / "steps"
    body = {"output_dir": str(out_dir), "num_steps": 2, "activities": []}
    status, out = serve.post("/start_profile", body)
    assert status == 200, out
    _load_requests(serve, 3)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(out_dir.glob("mpprefill.*.trace.json")):
        _load_requests(serve, 1)
    (merged,) = out_dir.glob("mpprefill.*.trace.json")
    assert not list(out_dir.glob("torch.*"))  # no activities: spans only
    forwards = [e for e in _load(merged)["traceEvents"] if e.get("name") == "forward"]
    assert 1 <= len(forwards) <= 3
    assert serve.post("/stop_profile", {})[0] == 400  # it stopped already


def test_bad_profile_bodies_are_400(serve):
    status, out = serve.post("/start_profile", {"activities": ["CPU", "RADAR"]})
    assert status == 400, out
    status, out = serve.post("/start_profile", {"num_steps": 0})
    assert status == 400, out
