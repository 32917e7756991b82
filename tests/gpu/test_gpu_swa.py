"""A sliding-window model on a GPU: the SWA pool in the worker's CUDA storage, its slots
through both stagings, logits equal to the CPU's dense sliding-window reference."""

from __future__ import annotations

import pytest
import torch

from mpprefill.engine import PrefillEngine
from tests.scheduling.test_swa_engine import ENGINE_KW, dense, prompts  # noqa: F401 - fixture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


@pytest.mark.parametrize(
    "mode, staging", [("normal", "pinned"), ("proc-ahead", "pinned"), ("proc-ahead", "cuda-ipc")]
)
def test_sliding_window_model_on_gpu(mode, staging, dense):  # noqa: F811 - the fixture
    with PrefillEngine(forward_mode=mode, device="cuda", staging=staging, **ENGINE_KW) as eng:
        outs = eng.prefill(prompts(), return_logits=True)
        assert eng.scheduler.tree.swa_total_size() < eng.scheduler.tree.total_size()
        eng.check_invariants(flush=True)
    for o, ref in zip(outs, dense):
        torch.testing.assert_close(o.logits.cpu(), ref, atol=2e-2, rtol=2e-2)
    assert sum(o.cached_tokens for o in outs) > 0
