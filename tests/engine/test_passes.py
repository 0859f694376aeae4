"""passes.py: one call's training requests in passes of bounded activation memory (the engine's use of it is
tested in test_runs.py)."""

from __future__ import annotations

import pytest
import torch

from tests.models import VOCAB
from whitney.engine import Datum, Engine, ForwardRequest, LoraConfig
from whitney.engine.training.passes import activation_bytes_per_token, plan_passes


def test_requests_fill_passes_in_order_up_to_the_budget_of_padded_tokens():
    # 4 x 64 each: three (768 tokens) fit 800, the fourth starts the next pass
    assert plan_passes([(4, 64)] * 7, 800) == [[0, 1, 2], [3, 4, 5], [6]]
    # padding counts: (1 x 10) + (1 x 100) is 2 rows of 100 = 200 tokens, over 150
    assert plan_passes([(1, 10), (1, 100)], 150) == [[0], [1]]
    assert plan_passes([(1, 10), (1, 100)], 200) == [[0, 1]]
    # a request beyond the budget alone, and the next one does not join it
    assert plan_passes([(1, 5), (8, 64), (1, 5)], 100) == [[0], [1], [2]]
    assert plan_passes([], 100) == []


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_the_estimate_covers_what_a_pass_saves_for_its_backward(model, request):
    """What autograd saves during a forward_backward (every saved tensor's storage, once, less the frozen base
    weights) per token is at most the estimate, and at least a third of it (an estimate, not a gross one)."""
    path = request.getfixturevalue(model)
    engine = Engine(device="cpu")
    base = engine.load_model(path)
    engine.create_run("r", path, LoraConfig(rank=8, seed=0))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (65,), generator=g).tolist() for _ in range(4)]
    data = [Datum(s[:-1], {"target_tokens": s[1:]}) for s in seqs]
    frozen = {t.untyped_storage().data_ptr() for t in [base.embed, base.lm_head, base.final_norm]}
    frozen |= {t.untyped_storage().data_ptr() for layer in base.layers
               for t in [*layer.linear.values(), layer.input_norm, layer.post_attn_norm]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in frozen:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.run_batch([ForwardRequest("r", data)], backward=True)
    per_token = sum(saved.values()) / (4 * 64)
    estimate = activation_bytes_per_token(base.config, base.compute_dtype)
    assert per_token <= estimate <= 3 * per_token, (per_token, estimate)
