"""What a sampling request asks about its own prompt, computed from the prefill's logits.

Three kinds, each at temperature 1 (log_softmax of the logits, as every reported log-prob):
  prompt_logprobs       [P]      log-prob of each prompt token; position 0 (no context) is None
  topk_prompt_logprobs  [P] of k the k most likely (token, log-prob) at each position; position 0 None
  target_prompt_logprobs [P-1, K] log-prob of chosen ids: cell [i][j] is scored at position i + 1; None
                                  where the request's id is -1
`prompt_logprobs_last_n` n scores only the last n positions for the first two (earlier entries None);
it does not apply to the targets (as in Tinker's SDK).

Shape legend: P prompt length, V vocabulary, K target ids per position.
"""

from __future__ import annotations

import torch

from whitney.engine.families.decoder import full_logprobs


def score_prompt(prompt: list[int], params, logits: torch.Tensor) -> tuple[list | None, list | None, list | None]:
    """(prompt_logprobs [P], topk_prompt_logprobs [P], target_prompt_logprobs [P-1, K]) for a request's
    SamplingParams from the prompt's logits [P, V]; each None when not asked."""
    lp = full_logprobs(logits[:-1])  # [P-1, V]: position t predicts prompt[t + 1]
    skip = 0 if params.prompt_logprobs_last_n is None else len(prompt) - 1 - params.prompt_logprobs_last_n
    scored = lp[skip:]  # [P-1-skip, V]
    logprobs = topk = targets = None
    if params.prompt_logprobs:
        ids = torch.tensor(prompt[1 + skip:], dtype=torch.int64, device=logits.device)
        logprobs = [None] * (1 + skip) + scored.gather(1, ids[:, None])[:, 0].tolist()
    if params.topk_prompt_logprobs > 0:
        top = torch.topk(scored, params.topk_prompt_logprobs, dim=-1)
        topk = [None] * (1 + skip) + [list(zip(ids, vals)) for ids, vals in
                                      zip(top.indices.tolist(), top.values.tolist())]
    if params.target_prompt_logprobs is not None:
        ids = torch.tensor(params.target_prompt_logprobs, dtype=torch.int64, device=logits.device)  # [P-1, K]
        values = lp.gather(1, ids.clamp(min=0)).tolist()
        targets = [[v if t >= 0 else None for t, v in zip(row_ids, row)]
                   for row_ids, row in zip(params.target_prompt_logprobs, values)]
    return logprobs, topk, targets
