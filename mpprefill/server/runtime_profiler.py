"""`start_profile` / `stop_profile` in the scheduler process: the span tracer of this
process and of the forward process, and torch's profiler where the forward runs.

Where the forward runs in its own process (proc, proc-ahead) the torch profiler runs
there, reached through its control socket (`worker/profile_control.py`); in the other modes it
runs here, recording the forward thread too. A stop (or the `num_steps`-th forward after
the start) writes, into the start's output_dir:

- `mpprefill.<stamp>.trace.json`: both processes' spans merged (Chrome trace JSON);
- `torch.<process>.<pid>.<stamp>.trace.json`: torch's trace of the forward's process.

NOTE: a stop runs on the scheduler's loop and waits for the torch trace to be written
(seconds on a long window): the loop stalls for that long, as SGLang's does.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from mpprefill.protocol import StartProfile
from mpprefill.trace import chrome
from mpprefill.trace.profiler import TorchProfile, TraceWindow, wants_torch
from mpprefill.worker.profile_control import ProfileControl

logger = logging.getLogger(__name__)


class RuntimeProfiler:
    def __init__(self, forward_pid: int | None):
        """`forward_pid`: the forward process, None where the forward runs here."""
        self.control = ProfileControl(forward_pid) if forward_pid is not None else None
        self.active: StartProfile | None = None
        self._window: TraceWindow | None = None
        self._torch: TorchProfile | None = None
        self._stop_at: int | None = None  # the batch count that ends a num_steps profile

    def start(self, msg: StartProfile, num_batches: int) -> tuple[bool, str]:
        if self.active is not None:
            return False, f"already profiling into {self.active.output_dir}"
        try:
            os.makedirs(msg.output_dir, exist_ok=True)
            self._window = TraceWindow("scheduler")
        except (OSError, RuntimeError) as e:
            return False, f"cannot profile: {e}"
        if self.control is not None:
            cmd = {"cmd": "start", "output_dir": msg.output_dir, "activities": msg.activities}
            reply = self.control.request(cmd)
            if not reply.get("ok"):
                self._window.stop(msg.output_dir)
                return False, f"the forward process cannot profile: {reply.get('error')}"
        elif wants_torch(msg.activities):
            self._torch = TorchProfile(msg.activities, "scheduler")
        self.active = msg
        self._stop_at = num_batches + msg.num_steps if msg.num_steps else None
        logger.info("profiling into %s (%s steps)", msg.output_dir, msg.num_steps or "until stop")
        return True, f"profiling into {msg.output_dir}"

    def forget_forward_process(self) -> None:
        """The forward process is killed at once: its control socket's file goes here."""
        if self.control is not None:
            self.control.remove_endpoint()

    def poll(self, num_batches: int) -> None:
        """Stop a num_steps profile once that many forwards ran."""
        if self._stop_at is not None and num_batches >= self._stop_at:
            ok, message, _ = self.stop()
            logger.log(logging.INFO if ok else logging.WARNING, "profile stopped: %s", message)

    def stop(self) -> tuple[bool, str, list[str]]:
        if self.active is None:
            return False, "not profiling", []
        out_dir, self.active, self._stop_at = self.active.output_dir, None, None
        dumps = [self._window.stop(out_dir)]
        files, errors = [], []
        if self.control is not None:
            reply = self.control.request({"cmd": "stop"})
            if reply.get("ok"):
                dumps.append(Path(reply["files"]["trace"]))
                files += [reply["files"]["torch"]] if "torch" in reply["files"] else []
            else:
                errors.append(f"forward process: {reply.get('error')}")
        elif self._torch is not None:
            files.append(str(self._torch.stop(out_dir)))
            self._torch = None
        files.insert(0, str(self._merge(dumps, out_dir)))
        message = "; ".join(errors) or f"wrote {', '.join(files)}"
        return not errors, message, files

    @staticmethod
    def _merge(dumps: list[Path], out_dir: str) -> Path:
        """Both processes' spans in one Chrome trace; the per-process dumps go."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        merged = chrome.merge(dumps, Path(out_dir) / f"mpprefill.{stamp}.trace.json")
        for dump in dumps:
            dump.unlink(missing_ok=True)
        return merged
