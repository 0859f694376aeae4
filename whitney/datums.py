"""Building datums in the wire format ({input: {token_ids}, loss_inputs: {name: {dtype, shape, values}}}).

Standard library only, so a client needs nothing else. Conversations are rendered by the server, with the
served model's own tokenizer and chat template (`render_chat`, `POST /v1/chat/render`), and `chat_datum`
trains on the assistant messages' tokens, end-of-turn tokens included, whatever the template writes.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def tensor(values: list, dtype: str, shape: list[int] | None = None) -> dict:
    """A dense wire tensor; `values` flat in row-major order (or a list of rows, flattened here)."""
    if values and isinstance(values[0], list):
        shape = shape or [len(values), len(values[0])]
        values = [v for row in values for v in row]
    return {"dtype": dtype, "shape": shape or [len(values)], "values": values}


def sft_datum(prompt_tokens: list[int], completion_tokens: list[int]) -> dict:
    """Right-shift the sequence by one position and weight only the completion span."""
    full = prompt_tokens + completion_tokens
    input_tokens, target_tokens = full[:-1], full[1:]
    pad_len = len(prompt_tokens) - 1
    weights = [0.0] * pad_len + [1.0] * len(completion_tokens)
    return {
        "input": {"token_ids": input_tokens},
        "loss_inputs": {
            "target_tokens": {"dtype": "int64", "shape": [len(target_tokens)], "values": target_tokens},
            "weights": {"dtype": "float32", "shape": [len(weights)], "values": weights},
        },
    }


def rl_datum(prompt_tokens: list[int], completion_tokens: list[int], sampler_logprobs: list[float],
             advantage: float) -> dict:
    """A policy-gradient datum: the completion's tokens, the sampler's log-probs and one advantage.

    Prompt positions get advantage 0 (no update); `sampler_logprobs` are per completion token.
    """
    if len(sampler_logprobs) != len(completion_tokens):
        raise ValueError(f"{len(sampler_logprobs)} sampler log-probs for {len(completion_tokens)} completion tokens")
    if not prompt_tokens or not completion_tokens:
        raise ValueError("rl_datum needs a non-empty prompt and completion")
    full = prompt_tokens + completion_tokens
    pad = len(prompt_tokens) - 1
    return {
        "input": {"token_ids": full[:-1]},
        "loss_inputs": {
            "target_tokens": tensor(full[1:], "int64"),
            "old_logprobs": tensor([0.0] * pad + list(sampler_logprobs), "float32"),
            "advantages": tensor([0.0] * pad + [float(advantage)] * len(completion_tokens), "float32"),
        },
    }


def soft_target_datum(input_tokens: list[int], candidates: list[list[int]], probs: list[list[float]]) -> dict:
    """Soft targets for cross_entropy: K candidate ids and teacher probabilities per position ([N, K])."""
    if len(candidates) != len(input_tokens) or len(probs) != len(input_tokens):
        raise ValueError("candidates and probs need one row per input token")
    return {"input": {"token_ids": input_tokens},
            "loss_inputs": {"target_tokens": tensor(candidates, "int64"), "weights": tensor(probs, "float32")}}


def render_chat(base_url: str, messages: list[dict], model: str | None = None, api_key: str | None = None,
                timeout: float = 60.0) -> dict:
    """The server's rendering of a conversation with the model's own chat template (POST /v1/chat/render):
    {model, tokens, assistant_mask}. `model`: a served base model (default the server's first), a run's
    "<run_id>@<version>" or a checkpoint id (their base model's template)."""
    body = json.dumps({"messages": messages, **({"model": model} if model else {})}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/chat/render", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"POST /v1/chat/render: {e.code} {e.read().decode(errors='replace')}") from None


def chat_datum(rendering: dict) -> dict:
    """An SFT datum from a rendered conversation ({tokens, assistant_mask}, as `render_chat` returns it):
    right-shifted, weight 1 on predicting each assistant token, 0 elsewhere."""
    tokens, mask = rendering["tokens"], rendering["assistant_mask"]
    if len(tokens) != len(mask) or len(tokens) < 2 or not any(mask[1:]):
        raise ValueError("a chat datum needs at least two tokens and an assistant message after the first token")
    return {"input": {"token_ids": tokens[:-1]},
            "loss_inputs": {"target_tokens": tensor(tokens[1:], "int64"),
                            "weights": tensor([float(m) for m in mask[1:]], "float32")}}
