"""The offline API: prefill a list of prompts through any forward mode."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from mpprefill.config import DEFAULT_MAX_TOTAL_TOKENS, ServerArgs
from mpprefill.disagg.sender import FakeTransfer
from mpprefill.sampling.params import SamplingParams
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Flushed, Scheduler
from mpprefill.worker.api import WorkerDied
from mpprefill.worker.factory import make_worker


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    rid: str
    first_token: int
    prompt_tokens: int
    cached_tokens: int
    logits: torch.Tensor | None = None  # last position, float32


class PrefillEngine:
    """`with PrefillEngine(...) as eng: outs = eng.prefill([[1, 2, 3]])`.

    `kwargs` are ServerArgs fields, e.g. `dtype="bfloat16"` (the weights and activations)
    and `kv_cache_dtype` (the KV pool); logits come back float32 whatever they are. The
    device is `auto` by default (CUDA where torch sees one); the KV pool holds
    `max_total_tokens` (default 16,384 on every device: not sized from free memory, so
    engines made one after another in a process all fit)."""

    def __init__(
        self,
        model_path: str | None = None,
        forward_mode: str | None = "proc-ahead",
        page_size: int = 16,
        chunked_prefill_size: int = 512,
        **kwargs,
    ):
        kwargs.setdefault("max_total_tokens", DEFAULT_MAX_TOTAL_TOKENS)
        self.args = ServerArgs(
            model_path=model_path,
            forward_mode=forward_mode,
            page_size=page_size,
            chunked_prefill_size=chunked_prefill_size,
            **kwargs,
        )
        self.mode = self.args.mode
        self.worker, self.model_config = make_worker(self.args, self.mode)
        self.scheduler = Scheduler(self.args, self.model_config, self.worker, FakeTransfer())
        self._loop = LOOPS[self.mode.name]
        self._ids = itertools.count()
        self._closed = False

    def prefill(
        self,
        prompts: list[list[int]],
        return_logits: bool = False,
        sampling_params: SamplingParams | dict | None = None,
        timeout: float | None = None,
    ) -> list[PrefillOutput]:
        """Prefill every prompt; bad input raises ValueError before anything runs.

        `timeout` (seconds) bounds the whole call: TimeoutError if requests remain.
        """
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams.from_dict(sampling_params)
        params = sampling_params or SamplingParams()
        reqs = [
            Req(f"offline-{next(self._ids)}", list(p), params, return_logits=return_logits)
            for p in prompts
        ]
        for r in reqs:
            self.scheduler.validate(r)
        for r in reqs:
            self.scheduler.add_request(r)
        s = self.scheduler
        deadline = None if timeout is None else time.monotonic() + timeout

        def until() -> bool:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(s.reqs.live)} requests unfinished after {timeout}s")
            return not s.reqs.live and s.forwards_in_flight == 0

        try:
            self._loop(s, until)
        except WorkerDied as e:
            s.reqs.fail_all(str(e))
            self.worker.kill_now()  # a stalled rank would not answer a graceful exit
            self.close()
            raise
        if self.args.check_invariants:
            self.check_invariants()
        return [self._output(r) for r in reqs]

    @staticmethod
    def _output(r: Req) -> PrefillOutput:
        if r.error:
            raise RuntimeError(f"request {r.rid} failed: {r.error}")
        return PrefillOutput(r.rid, r.first_token, r.prompt_len, r.cached_tokens, r.logits)

    def check_invariants(self, flush: bool = False) -> None:
        from mpprefill.scheduling.invariants import check_drained

        check_drained(self.scheduler, flush=flush)

    def flush_cache(self) -> Flushed:
        """Drop the prefix cache and the host tier; the tokens dropped per tier."""
        return self.scheduler.flush_caches()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.scheduler.host_tier is not None:
                self.scheduler.host_tier.close()  # waits for the last host copies
            self.worker.close()

    def __enter__(self) -> PrefillEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
