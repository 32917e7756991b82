"""The forward modes: where run_batch runs and how the scheduler overlaps it.

| mode         | worker  | overlaps the forward | builds the next batch ahead |
|--------------|---------|----------------------|-----------------------------|
| normal       | inline  | no                   | no                          |
| overlap      | inline  | yes                  | no                          |
| thread       | thread  | yes                  | no                          |
| thread-ahead | thread  | yes                  | yes                         |
| proc         | process | yes                  | no                          |
| proc-ahead   | process | yes                  | yes                         |

`resolve_forward_mode` turns the flags and the environment into a name once, where
`ServerArgs` is made; the code below asks the entry's fields, never the name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

INLINE = "inline"  # run_batch on the scheduler's thread
THREAD = "thread"  # on a forward thread of the scheduler's process
PROCESS = "process"  # in forward processes (one per tensor-parallel rank)


@dataclass(frozen=True, slots=True)
class ForwardMode:
    name: str
    worker: str  # INLINE | THREAD | PROCESS
    overlap: bool  # the scheduler prepares batch N+1 while batch N runs
    ahead: bool  # and admits and builds it before N's results are in

    @property
    def in_process(self) -> bool:
        """The forward runs in processes of its own (a group of ranks can run)."""
        return self.worker == PROCESS

    @property
    def on_thread(self) -> bool:
        """The forward runs on a thread of the scheduler's process."""
        return self.worker == THREAD

    @property
    def inline(self) -> bool:
        """The forward runs on the scheduler's own thread."""
        return self.worker == INLINE


MODES: dict[str, ForwardMode] = {
    m.name: m
    for m in (
        ForwardMode("normal", INLINE, overlap=False, ahead=False),
        ForwardMode("overlap", INLINE, overlap=True, ahead=False),
        ForwardMode("thread", THREAD, overlap=True, ahead=False),
        ForwardMode("thread-ahead", THREAD, overlap=True, ahead=True),
        ForwardMode("proc", PROCESS, overlap=True, ahead=False),
        ForwardMode("proc-ahead", PROCESS, overlap=True, ahead=True),
    )
}
FORWARD_MODES = tuple(MODES)
NO_OVERLAP = MODES["normal"]  # --disable-overlap-schedule's mode
DEFAULT_MODE = MODES["proc-ahead"]


def resolve_forward_mode(
    mode: str | None, disable_overlap: bool, env: dict[str, str] | None = None
) -> str:
    """--forward-mode wins; then --disable-overlap-schedule; then the env aliases.

    SGLANG_ENABLE_PREFILL_FWD_THREAD=1 gives `thread`, plus
    SGLANG_PREFILL_FWD_THREAD_AHEAD=1 `thread-ahead`; MPPREFILL_FORWARD_MODE names a
    mode. With none of them: `proc-ahead`.
    """
    env = os.environ if env is None else env
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"--forward-mode must be one of {FORWARD_MODES}")
        if disable_overlap and MODES[mode].overlap:
            raise ValueError(
                f"--forward-mode {mode} needs the overlap schedule, "
                "but --disable-overlap-schedule was given"
            )
        return mode
    if disable_overlap:
        return NO_OVERLAP.name
    named = env.get("MPPREFILL_FORWARD_MODE")
    if named:
        if named not in MODES:
            raise ValueError(f"MPPREFILL_FORWARD_MODE={named!r}: one of {FORWARD_MODES}")
        return named
    if _truthy(env.get("SGLANG_ENABLE_PREFILL_FWD_THREAD")):
        return "thread-ahead" if _truthy(env.get("SGLANG_PREFILL_FWD_THREAD_AHEAD")) else "thread"
    return DEFAULT_MODE.name


def check_dispatch(mode: ForwardMode, role: str, pp_size: int) -> None:
    """The off-thread loops exist for the prefill role, pipeline parallel 1, with overlap."""
    if pp_size != 1:
        raise ValueError(f"--pp-size {pp_size}: pipeline parallelism is not supported")
    if not mode.inline and role != "prefill":
        raise ValueError(
            f"--forward-mode {mode.name} runs only with --disaggregation-mode prefill"
            f" (got {role!r})"
        )


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")
