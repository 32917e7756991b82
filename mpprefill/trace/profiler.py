"""Profiling switched on and off at run time (`POST /start_profile`, `/stop_profile`):
this process's span tracer over a window, and the torch profiler.

`TraceWindow` turns the process's tracer (tracer.py) on and off again, and writes what it
recorded in between as a dump that `chrome.merge` joins with the other processes' into
one Chrome trace. `TorchProfile` runs torch's profiler on every thread of the process
(the forward runs on another thread than the one that starts it) and writes its Chrome
trace JSON. Both open in Perfetto.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mpprefill.trace.tracer import get_tracer

TORCH_ACTIVITIES = ("CPU", "GPU")  # SGLang's names; "MEM" adds memory events


class TraceWindow:
    """The tracer of this process, on from `start` to `stop`."""

    def __init__(self, process_name: str):
        tracer = get_tracer()
        if tracer.enabled:
            raise RuntimeError("this process already traces (--trace-dir)")
        self.tracer = tracer
        tracer.records = []
        tracer.threads = {}
        tracer.process_name = process_name
        tracer.enabled = True

    def stop(self, out_dir: str | os.PathLike) -> Path:
        """Off, and the spans of the window dumped into `out_dir` (then dropped here)."""
        self.tracer.enabled = False
        try:
            return self.tracer.dump(Path(out_dir) / self.tracer.dump_name())
        finally:
            self.tracer.records = []


class TorchProfile:
    """torch.profiler over every thread of this process, from construction to `stop`."""

    def __init__(self, activities: tuple[str, ...] | list[str], label: str):
        import torch
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        kinds = [ProfilerActivity.CPU]
        if "GPU" in activities and torch.cuda.is_available():
            kinds.append(ProfilerActivity.CUDA)
        self.label = label
        self.prof = profile(
            activities=kinds,
            record_shapes=True,
            profile_memory="MEM" in activities,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        self.prof.start()

    def stop(self, out_dir: str | os.PathLike) -> Path:
        """Stopped, and its Chrome trace written into `out_dir`."""
        self.prof.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(out_dir) / f"torch.{self.label}.{os.getpid()}.{stamp}.trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(path))
        return path


def wants_torch(activities: tuple[str, ...] | list[str]) -> bool:
    return any(a in TORCH_ACTIVITIES for a in activities)
