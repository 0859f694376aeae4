"""tinker-cookbook 0.6.1's self-distillation recipe (recipes/sdft, distillation/sdft.py), unmodified, against
Whitney, offline, in its default (forward-KL) mode: the teacher's top-20 prompt log-probs (`topk_prompt_logprobs`)
become soft targets for a [N, K] cross-entropy.

Not covered: `reverse=True` (a client-side `forward_backward_custom` loss over the same top-K) needs the forward
output `logprobs` of [N, K] target_tokens as [N, K], as Tinker returns them; Whitney returns one weight-normalised
log-prob per position ([N]), so the recipe's loss fails on the shapes.

The recipe's ToolAlpaca dataset reads a local Arrow directory when given one (`toolalpaca_data_path`), so the test
writes a few rows with `datasets` instead of downloading it; the tiny model's directory is its own tokenizer and
the role_colon renderer needs no tml-renderers (see test_cookbook.py for how `make test` installs the cookbook).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from tinker_cookbook.recipes.sdft import train  # installed by `make test`: a missing install fails, never skips

ROWS = [  # (prompt, golden response): ToolAlpaca's shape, a list of lines or one string
    ("What is the weather in Paris?", ["Action: getWeather", 'Action Input: {"city": "Paris"}']),
    ("Convert 3 dollars to euros.", "Action: convert\nAction Input: {\"amount\": 3}"),
    ("Find a recipe with eggs.", ["Action: searchRecipes", 'Action Input: {"q": "eggs"}']),
    ("Translate hello to French.", "Action: translate\nAction Input: {\"text\": \"hello\"}"),
    ("List today's news.", ["Action: getNews"]),
    ("How tall is Mont Blanc?", "Action: search\nAction Input: {\"q\": \"Mont Blanc height\"}"),
]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def toolalpaca(tmp_path_factory) -> str:
    from datasets import Dataset

    path = tmp_path_factory.mktemp("toolalpaca") / "arrow"
    Dataset.from_dict({"prompt": [p for p, _ in ROWS], "golden_response": [str(a) if isinstance(a, str) else
                                                                           "\n".join(a) for _, a in ROWS]}
                      ).save_to_disk(str(path))
    return str(path)


def test_sdft_topk_distillation(tinker_env, tiny_llama, tmp_path, toolalpaca):
    log_path = tmp_path / "sdft"
    config = train.CLIConfig(model_name=tiny_llama, renderer_name="role_colon", dataset="toolalpaca",
                             toolalpaca_data_path=toolalpaca, lora_rank=4, group_size=1, groups_per_batch=2,
                             learning_rate=1e-3, max_tokens=6, topk=20, max_context_length=512,
                             eval_every=0, save_every=0, max_steps=2, log_path=str(log_path),
                             base_url=tinker_env.url, behavior_if_log_dir_exists="delete")
    asyncio.run(train.cli_main(config))
    metrics = [m for m in rows(log_path / "metrics.jsonl") if "sdft/topk" in m]
    assert [m["step"] for m in metrics] == [1.0, 2.0]
    for m in metrics:
        assert m["sdft/topk"] == 20.0 and m["sdft/total_completion_tokens"] > 0
        # Only positions the teacher's top-20 covered add entropy (of the renormalised top 20, at most log 20):
        # none if the server had returned no top-k rows.
        assert 0 < m["sdft/mean_teacher_entropy"] <= math.log(20)
        assert all(v == v for v in m.values() if isinstance(v, float))  # no NaN anywhere
    assert rows(log_path / "checkpoints.jsonl")[-1]["name"] == "final"
