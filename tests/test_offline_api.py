"""The offline API exactly as CONTRACT.md shows it."""

import torch


def test_contract_example():
    from mpprefill import PrefillEngine

    with PrefillEngine(
        model_path=None, forward_mode="proc-ahead", page_size=16, chunked_prefill_size=512
    ) as eng:
        outs = eng.prefill([[1, 2, 3], [1, 2, 4, 5]], return_logits=True)
    assert len(outs) == 2
    for o, n in zip(outs, (3, 4)):
        assert isinstance(o.first_token, int) and o.cached_tokens == 0 and o.prompt_tokens == n
        assert o.logits.dtype == torch.float32 and o.logits.shape == (4096,)
        assert o.first_token == int(o.logits.argmax())
