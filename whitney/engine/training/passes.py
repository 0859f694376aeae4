"""Training passes: how one engine call's forward_backward requests are grouped into forward+backward passes
whose kept activations fit a memory budget.

A pass keeps every layer's activations until its backward, so its memory grows with its padded tokens
(rows x longest row), while its time per run does not fall past a few runs (docs/BENCHMARKS.md): one huge
pass holds many times the memory of several smaller ones and is no faster per run. Each request stays whole
in one pass, so its results and gradient are those of one pass (to float rounding: a GEMM's blocking may
follow its rows); one larger than the budget runs alone (the service's max_batch_tokens bounds it).
"""

from __future__ import annotations

import torch

from whitney.engine.families.decoder import ModelConfig

CPU_PASS_MIB = 2048  # the CPU's default budget: about 900 tokens of SmolLM2 in float32
ACCELERATOR_PASS_FRACTION = 4  # an accelerator's default budget: a quarter of its memory


def default_pass_mib(device: torch.device) -> int:
    """The budget of one pass where the operator set none (EngineConfig.max_pass_mib): CPU_PASS_MIB on the
    CPU, 1/ACCELERATOR_PASS_FRACTION of the device's memory on an accelerator."""
    if device.type == "cpu":
        return CPU_PASS_MIB
    return torch.cuda.get_device_properties(device).total_memory // ACCELERATOR_PASS_FRACTION // 2**20


def activation_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Estimated peak memory of a training pass per token: per layer, and once more for the embedding, final
    norm and unembedding, 12 hidden-wide and 8 MLP-wide values in the compute dtype. About twice what autograd
    saves for the backward (norm inputs, q/k/v, attention output, residuals; gate, up, their activation and
    product): the backward's own tensors come on top. Checked against the peak RSS of real passes
    (docs/BENCHMARKS.md)."""
    mlp = config.intermediate_size or 4 * config.hidden_size  # the general path may not know it (MoE)
    return (config.num_layers + 1) * (12 * config.hidden_size + 8 * mlp) * torch.finfo(dtype).bits // 8


def plan_passes(shapes_R: list[tuple[int, int]], budget_tokens: int) -> list[list[int]]:
    """Split requests, in order, into consecutive passes of at most `budget_tokens` padded tokens.

    shapes_R[i]: request i's (rows, longest row). A pass of rows r_j padded to their longest T costs
    sum(r_j) x T tokens; a request that alone exceeds the budget gets a pass of its own. Returns each pass's
    request indices.
    """
    passes: list[list[int]] = []
    rows = longest = 0
    for i, (r, t) in enumerate(shapes_R):
        if passes and (rows + r) * max(longest, t) <= budget_tokens:
            passes[-1].append(i)
            rows, longest = rows + r, max(longest, t)
        else:
            passes.append([i])
            rows, longest = r, t
    return passes
