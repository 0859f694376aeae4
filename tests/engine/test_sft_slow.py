"""The real SmolLM2-135M: 20 SFT steps on a small fixed dataset lower the loss."""

from __future__ import annotations

import pytest

from whitney.demo import CHATS, chat_datums
from whitney.engine import DEFAULT_MODEL, AdamParams, Datum, Engine, LoraConfig


@pytest.mark.slow
def test_twenty_sft_steps_lower_the_loss_on_smollm2(torch_threads):
    engine = Engine()
    run = engine.create_run("sft", DEFAULT_MODEL, LoraConfig(rank=8, seed=0))
    datums = [Datum(d["input"]["token_ids"], d["loss_inputs"]) for d in chat_datums(run.base.tokenizer, CHATS[:4])]
    # The whole dataset's loss before and after, measured with forward (no gradient).
    before = engine.forward("sft", datums).loss
    assert before == pytest.approx(engine.forward(None, datums, base_model=DEFAULT_MODEL).loss, rel=1e-6), \
        "a fresh run must equal the base model"
    for step in range(20):
        batch = [datums[(2 * step) % 4], datums[(2 * step + 1) % 4]]
        engine.forward_backward("sft", batch)
        engine.optim_step("sft", AdamParams(learning_rate=1e-3))
    after = engine.forward("sft", datums).loss
    assert after < 0.5 * before, f"20 steps took the dataset loss only from {before:.2f} to {after:.2f}"
