"""Shared data for the Tinker tests: the same datums as Tinker types and as native wire dicts."""

from __future__ import annotations

import numpy as np

RTOL = 1e-5
SEQUENCES = [[1, 17, 250, 4000, 12, 99, 3071, 8], [5, 6, 7, 8, 9, 10]]


def arrays(loss_fn: str, rng_seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Per datum: tokens [N+1] and each loss input [N], for a loss."""
    rng = np.random.default_rng(rng_seed)
    out = []
    for seq in SEQUENCES:
        n = len(seq) - 1
        d = {"tokens": np.array(seq), "target_tokens": np.array(seq[1:], dtype=np.int64)}
        if loss_fn == "cross_entropy":
            d["weights"] = rng.uniform(0.0, 1.0, n).astype(np.float32)
        else:
            d["logprobs"] = rng.uniform(-11.5, -10.0, n).astype(np.float32)
            d["advantages"] = rng.normal(0.0, 1.0, n).astype(np.float32)
        if loss_fn == "gspo":  # the sequence ratio over all but the first (prompt) position
            d["sequence_ratio_mask"] = np.array([0.0] + [1.0] * (n - 1), dtype=np.float32)
        out.append(d)
    return out


def tinker_data(items: list[dict]) -> list:
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"][:-1].tolist()),
                        loss_fn_inputs={k: v for k, v in d.items() if k != "tokens"}) for d in items]


def native_data(items: list[dict]) -> list[dict]:
    def tensor(v: np.ndarray) -> dict:
        dtype = "int64" if v.dtype.kind == "i" else "float32"
        return {"dtype": dtype, "shape": list(v.shape), "values": v.flatten().tolist()}

    return [{"input": {"token_ids": d["tokens"][:-1].tolist()},
             "loss_inputs": {k: tensor(v) for k, v in d.items() if k != "tokens"}} for d in items]


def sdk_logprobs(result) -> list[list[float]]:
    return [o["logprobs"].to_numpy().tolist() for o in result.loss_fn_outputs]


def close(a, b, rtol: float = RTOL) -> None:
    """Equal within rtol; lists of per-datum lists are compared datum by datum."""
    if isinstance(a, list) and a and isinstance(a[0], list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            close(x, y, rtol)
        return
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=rtol, atol=1e-6)
