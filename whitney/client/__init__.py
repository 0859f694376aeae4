"""A thin HTTP client for Whitney's native API.

Every operation returns an `OperationFuture` at once, so a loop can pipeline (submit seq 5 before 4
has finished); `.result()` long-polls until the operation is terminal. A run numbers its seq_ids
itself and resends the same seq_id and body after a network error, which the server deduplicates.

    client = whitney.Client("http://127.0.0.1:8000")
    run = client.create_session().create_run(rank=32)
    fb = run.forward_backward(data, loss_fn="cispo", eps_max=8.0)
    step = run.optim_step(learning_rate=1e-4)
    print(fb.result()["loss"], step.result()["metrics"])
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import httpx

RETRY_STATUS = (502, 503, 504)


class WhitneyAPIError(Exception):
    """The server refused a request (4xx) or an operation failed. `.body` is the server's error object."""

    def __init__(self, status: int | None, body: dict):
        super().__init__(f"{status or 'failed'}: {body.get('message', body)}")
        self.status = status
        self.body = body
        self.field = body.get("field")
        self.datum_index = body.get("datum_index")


class Client:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0, retries: int = 5):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries = retries

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs) -> Any:
        """One call with retries on network errors and 502-504 (safe: operations are idempotent by seq_id)."""
        for attempt in range(self.retries + 1):
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                time.sleep(min(0.2 * 2 ** attempt, 5.0))
                continue
            if response.status_code in RETRY_STATUS and attempt < self.retries:
                time.sleep(min(0.2 * 2 ** attempt, 5.0))
                continue
            if response.status_code >= 400:
                try:
                    body = response.json()
                except ValueError:
                    body = {"message": response.text}
                raise WhitneyAPIError(response.status_code, body)
            return response.json() if response.headers.get("content-type", "").startswith("application/json") \
                else response.content
        raise AssertionError("unreachable")

    # ---- resources ------------------------------------------------------------------------

    def capabilities(self) -> dict:
        return self.request("GET", "/v1/training/capabilities")

    def create_session(self, **user_metadata) -> "Session":
        return Session(self, self.request("POST", "/v1/sessions", json={"user_metadata": user_metadata}))

    def list_sessions(self) -> list[dict]:
        return self.request("GET", "/v1/sessions")

    def operation(self, op_id: str) -> "OperationFuture":
        return OperationFuture(self, self.request("GET", f"/v1/operations/{op_id}"))

    def sample(self, prompt: list[int], *, base_model: str | None = None, checkpoint_id: str | None = None,
               **params) -> "OperationFuture":
        """Sample the base model or a saved checkpoint. See RunClient.sample for the parameters."""
        body = {"prompt": prompt, "base_model": base_model, "checkpoint_id": checkpoint_id, **params}
        return OperationFuture(self, self.request("POST", "/v1/samples", json=_drop_none(body)))

    def compute_logprobs(self, sequences: list[list[int]], *, base_model: str | None = None,
                         checkpoint_id: str | None = None) -> "OperationFuture":
        body = {"sequences": sequences, "base_model": base_model, "checkpoint_id": checkpoint_id}
        return OperationFuture(self, self.request("POST", "/v1/logprobs", json=_drop_none(body)))

    def list_checkpoints(self, run_id: str | None = None, kind: str | None = None) -> list[dict]:
        return self.request("GET", "/v1/checkpoints", params=_drop_none({"run_id": run_id, "kind": kind}))

    def get_checkpoint(self, checkpoint_id: str) -> dict:
        return self.request("GET", f"/v1/checkpoints/{checkpoint_id}")

    def delete_checkpoint(self, checkpoint_id: str) -> dict:
        return self.request("DELETE", f"/v1/checkpoints/{checkpoint_id}")

    def download_checkpoint(self, checkpoint_id: str, dest: str) -> str:
        """Fetch a package (PEFT adapter, merged model, state) and unpack it under dest; return its folder."""
        import io
        import os
        import tarfile

        data = self.request("GET", f"/v1/checkpoints/{checkpoint_id}/archive")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dest, filter="data")
            top = tar.getnames()[0].split("/")[0]
        return os.path.join(dest, top)


class Session:
    """A session; a daemon thread heartbeats it every `heartbeat_every` seconds until close()."""

    def __init__(self, client: Client, info: dict, heartbeat_every: float = 10.0):
        self.client, self.info, self.id = client, info, info["id"]
        self._closed = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, args=(heartbeat_every,), daemon=True)
        self._beat.start()

    def _heartbeats(self, every: float) -> None:
        while not self._closed.wait(every):
            try:
                self.heartbeat()
            except WhitneyAPIError:  # closed or expired server-side: nothing more to keep alive
                return
            except httpx.TransportError:
                continue
            except RuntimeError:  # the Client was closed
                return

    def create_run(self, base_model: str | None = None, *, rank: int = 32, alpha: float = 32.0, seed: int = 0,
                   train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
                   target_modules: list[str] | None = None, resume_from: str | None = None,
                   with_optimizer: bool = False, **user_metadata) -> "RunClient":
        """A LoRA run. `resume_from` binds a checkpoint at creation (then do not also load_state first)."""
        body: dict[str, Any] = {"base_model": base_model, "user_metadata": user_metadata}
        if resume_from is None or (rank, alpha, seed, train_attn, train_mlp, train_unembed, target_modules) != \
                (32, 32.0, 0, True, True, True, None):
            body["lora"] = _drop_none({"rank": rank, "alpha": alpha, "seed": seed, "train_attn": train_attn,
                                       "train_mlp": train_mlp, "train_unembed": train_unembed,
                                       "target_modules": target_modules})
        if resume_from is not None:
            body["resume_from"] = {"checkpoint_id": resume_from, "with_optimizer": with_optimizer}
        info = self.client.request("POST", f"/v1/sessions/{self.id}/runs", json=_drop_none(body))
        return RunClient(self.client, info)

    def runs(self) -> list[dict]:
        return self.client.request("GET", f"/v1/sessions/{self.id}/runs")

    def heartbeat(self) -> dict:
        return self.client.request("POST", f"/v1/sessions/{self.id}/heartbeat")

    def close(self) -> dict:
        self._closed.set()
        return self.client.request("POST", f"/v1/sessions/{self.id}/close")


class RunClient:
    """One run: each training call takes the next seq_id and returns a future."""

    def __init__(self, client: Client, info: dict):
        self.client, self.info, self.id = client, info, info["id"]
        self._next_seq = 0
        self._lock = threading.Lock()

    def _submit(self, kind: str, body: dict) -> "OperationFuture":
        with self._lock:
            seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        op = self.client.request("POST", f"/v1/runs/{self.id}/{kind}", json={"seq_id": seq_id, **body})
        return OperationFuture(self.client, op)

    def forward_backward(self, data: list[dict], loss_fn: str = "cross_entropy", **loss_config) -> "OperationFuture":
        """Loss, log-probs and accumulated gradients. Loss-specific settings are keyword arguments."""
        return self._submit("forward_backward", {"data": data, "loss_function": loss_fn, "loss_config": loss_config})

    def forward(self, data: list[dict], loss_fn: str = "cross_entropy", **loss_config) -> "OperationFuture":
        return self._submit("forward", {"data": data, "loss_function": loss_fn, "loss_config": loss_config})

    def forward_backward_custom(self, data: list[dict], loss_fn: Callable) -> dict:
        """A loss computed here in torch: loss_fn(data, logprobs) -> (loss, metrics), logprobs a list of [N].

        Runs forward for the log-probs, takes dL/dlogprob locally, then a cross_entropy pass with
        weights = -dL/dlogprob, whose gradient on the weights equals dL/dweights.
        """
        import torch

        forward = self.forward(data).result()
        logprobs = [torch.tensor(o["logprobs"], dtype=torch.float64, requires_grad=True) for o in forward["outputs"]]
        loss, metrics = loss_fn(data, logprobs)
        grads = torch.autograd.grad(loss, logprobs, allow_unused=True)
        weighted = []
        for datum, lp, g in zip(data, logprobs, grads):
            g = torch.zeros_like(lp) if g is None else g
            targets = datum["loss_inputs"]["target_tokens"]
            weighted.append({"input": datum["input"], "loss_inputs": {
                "target_tokens": targets,
                "weights": {"dtype": "float32", "shape": [len(g)], "values": (-g).tolist()}}})
        result = self.forward_backward(weighted).result()
        return {**result, "loss": float(loss.detach()), "metrics": {**result["metrics"], **(metrics or {})}}

    def optim_step(self, learning_rate: float = 1e-4, **adam_params) -> "OperationFuture":
        """AdamW: beta1, beta2, eps, weight_decay, gradient_clip_norm, lora_plus_ratio, gradient_scale."""
        return self._submit("optim_step", {"adam_params": {"learning_rate": learning_rate, **adam_params}})

    def save_state(self, name: str = "state", include_optimizer: bool = True) -> "OperationFuture":
        return self._submit("save_state", {"name": name, "include_optimizer": include_optimizer})

    def load_state(self, checkpoint_id: str) -> "OperationFuture":
        return self._submit("load_state", {"checkpoint_id": checkpoint_id})

    def load_state_with_optimizer(self, checkpoint_id: str) -> "OperationFuture":
        return self._submit("load_state_with_optimizer", {"checkpoint_id": checkpoint_id})

    def save_weights(self, name: str = "weights", merge: bool = False) -> "OperationFuture":
        return self._submit("save_weights", {"name": name, "merge": merge})

    def export_lora(self, name: str = "lora") -> "OperationFuture":
        return self._submit("export_lora", {"name": name})

    def save_weights_for_sampler(self) -> "OperationFuture":
        """Its result's `version` names an immutable snapshot to sample from."""
        return self._submit("save_weights_for_sampler", {})

    def sample(self, prompt: list[int], version: int, *, num_samples: int = 1, max_tokens: int = 16,
               temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, seed: int | None = None,
               stop: list | None = None, prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0) -> "OperationFuture":
        body = {"run_id": self.id, "version": version, "prompt": prompt, "num_samples": num_samples,
                "max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "seed": seed, "stop": stop, "prompt_logprobs": prompt_logprobs,
                "topk_prompt_logprobs": topk_prompt_logprobs}
        return OperationFuture(self.client, self.client.request("POST", "/v1/samples", json=_drop_none(body)))

    def compute_logprobs(self, sequences: list[list[int]], version: int) -> "OperationFuture":
        body = {"run_id": self.id, "version": version, "sequences": sequences}
        return OperationFuture(self.client, self.client.request("POST", "/v1/logprobs", json=body))

    def refresh(self) -> dict:
        self.info = self.client.request("GET", f"/v1/runs/{self.id}")
        return self.info

    def operations(self) -> list[dict]:
        return self.client.request("GET", f"/v1/runs/{self.id}/operations")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> dict:
        """Log values the loop computed (e.g. {"reward/mean": 0.41}) at `step`, by default the run's current
        optimizer step; the console charts them. A name logged again at a step replaces its value, so pass
        `step` where a resend must land on the same point."""
        import json

        # NaN and infinities are sent as they are (httpx's json= refuses them): the server names the metric.
        body = json.dumps(_drop_none({"step": step, "metrics": metrics}), allow_nan=True)
        return self.client.request("POST", f"/v1/runs/{self.id}/metrics", content=body,
                                   headers={"Content-Type": "application/json"})

    def metrics(self, *names: str) -> dict[str, dict]:
        """The logged series, {name: {"steps": [...], "values": [...]}}; names given: only those."""
        params = [("name", n) for n in names]
        return self.client.request("GET", f"/v1/runs/{self.id}/metrics", params=params)["metrics"]

    def log_samples(self, samples: list[dict], step: int | None = None) -> dict:
        """Log prompts and the completions sampled for them, each {"prompt", "completion", "reward"?,
        "metadata"?} (at most 64), as the samples of `step`, by default the run's current optimizer step; the
        console shows them as a table. They replace the samples logged at that step before."""
        import json

        body = json.dumps(_drop_none({"step": step, "samples": samples}), allow_nan=True)
        return self.client.request("POST", f"/v1/runs/{self.id}/samples", content=body,
                                   headers={"Content-Type": "application/json"})

    def samples(self, step: int | None = None, limit: int = 100) -> list[dict]:
        """The logged samples, newest step first (only those of `step` when given)."""
        params = _drop_none({"step": step, "limit": limit})
        return self.client.request("GET", f"/v1/runs/{self.id}/samples", params=params)["samples"]

    def finish(self) -> dict:
        return self.client.request("POST", f"/v1/runs/{self.id}/finish")

    def cancel(self) -> dict:
        return self.client.request("POST", f"/v1/runs/{self.id}/cancel")


class OperationFuture:
    """An operation on the server; `.result()` long-polls until it is terminal."""

    def __init__(self, client: Client, op: dict):
        self.client, self.op, self.id = client, op, op["id"]

    @property
    def status(self) -> str:
        return self.op["status"]

    def done(self) -> bool:
        return self.op["status"] in ("succeeded", "failed", "cancelled")

    def wait(self, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            hold = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            self.op = self.client.request("GET", f"/v1/operations/{self.id}", params={"wait": hold},
                                          timeout=hold + 30.0)
            if deadline is not None and time.monotonic() >= deadline:
                break
        return self.op

    def result(self, timeout: float | None = None) -> dict:
        """The operation's result; raises WhitneyAPIError if it failed or was cancelled."""
        op = self.wait(timeout)
        if op["status"] == "succeeded":
            return op["result"]
        if not self.done():
            raise TimeoutError(f"operation {self.id} is still {op['status']}")
        raise WhitneyAPIError(None, op["error"] or {"message": op["status"]})


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}
