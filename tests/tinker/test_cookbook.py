"""tinker-cookbook 0.6.1 recipes, unmodified, against Whitney, offline: math_rl (arithmetic) and chat_sl (with a resume).

`make test` installs the cookbook (`pip install tinker-cookbook==0.6.1` fails: tml-renderers is not on
PyPI, so the Makefile installs it with --no-deps plus the dependencies these recipes use). The tiny
model's directory is its own tokenizer, and the role_colon renderer needs no tml-renderers.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import tinker_cookbook  # installed by `make test`: a missing install fails, never skips


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_math_rl_arithmetic(tinker_env, tiny_llama, tmp_path):
    from tinker_cookbook.recipes.math_rl import train

    config = train.CLIConfig(model_name=tiny_llama, renderer_name="role_colon", env="arithmetic", group_size=2,
                             groups_per_batch=4, learning_rate=1e-3, max_tokens=4, lora_rank=4, eval_every=0,
                             save_every=2, log_path=str(tmp_path / "rl"), base_url=tinker_env.url,
                             behavior_if_log_dir_exists="delete", loss_fn="importance_sampling", max_steps=2)
    asyncio.run(train.cli_main(config))
    metrics = rows(tmp_path / "rl" / "metrics.jsonl")
    assert [m["step"] for m in metrics if "optim/lr" in m] == [1.0, 2.0]
    # The sampler's log-probs are the learner's: no KL between them before any update.
    assert abs(metrics[0]["optim/kl_sample_train_v2"]) < 1e-4
    assert rows(tmp_path / "rl" / "checkpoints.jsonl")[-1]["name"] == "final"


def test_chat_sl_and_resume(tinker_env, tiny_llama, tmp_path):
    from tinker_cookbook.recipes.chat_sl import train

    data = str(Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl")
    log_path = tmp_path / "sl"

    def run(max_steps: int, behavior: str) -> None:
        train.cli_main(train.CLIConfig(
            log_path=str(log_path), model_name=tiny_llama, dataset=data, renderer_name="role_colon", batch_size=2,
            max_steps=max_steps, save_every=1, eval_every=0, infrequent_eval_every=0, max_length=256, lora_rank=4,
            learning_rate=1e-3, base_url=tinker_env.url, behavior_if_log_dir_exists=behavior))

    run(2, "delete")
    saved = rows(log_path / "checkpoints.jsonl")
    assert saved[-1]["name"] == "final" and saved[-1]["state_path"].startswith("tinker://")
    # As if the first run had been stopped after its second step: drop the final checkpoint, then resume.
    (log_path / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in saved[:-1]))
    run(4, "resume")
    after = rows(log_path / "checkpoints.jsonl")[len(saved) - 1:]
    # A new session loaded 000001 (weights and optimizer) and trained batches 1, 2 and 3.
    assert saved[0]["state_path"].split(":train:")[0] not in {r["state_path"].split(":train:")[0] for r in after}
    assert [r["batch"] for r in after if r["name"] != "final"][-1] == 3 and after[-1]["name"] == "final"
    assert after[0]["elapsed_tokens"] > saved[0]["elapsed_tokens"]  # counted on from the checkpoint
    assert len([m for m in rows(log_path / "metrics.jsonl") if "train_mean_nll" in m]) == 2 + 3
