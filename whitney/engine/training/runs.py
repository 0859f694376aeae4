"""The training engine: base models loaded once, runs (adapter + gradients + optimizer) on top.

`Engine.run_batch` is the one path from requests to tensors: validate every request, group them by base
model and cut them into passes that fit the memory budget (passes.py), then run each pass (batch.py): all
datums of all runs padded into one [B, T] batch with rows grouped per adapter, the shared forward once, each
request's target log-probs and loss, and (for forward_backward) the gradients of the sum of the requests'
losses, each run's share added to that run's accumulator. A rejected request never reaches a pass, so it
never leaves a gradient.

Shape legend: B rows (datums), T padded length, D hidden, V vocab, N tokens of one request, K soft targets.
"""

from __future__ import annotations

import torch

from whitney.engine.families import vision
from whitney.engine.families.decoder import BaseModel
from whitney.engine.families.lora import Adapter, copy_adapter, init_adapter
from whitney.engine.families.model import COMPUTE_DTYPES, load_base_model, resolve_compute_dtype, resolve_device
from whitney.engine.losses.builtin import LOSSES
from whitney.engine.losses.datum import prepare_datum
from whitney.heap import release_memory
from whitney.engine.memory.paging import Pager, RunStateLost
from whitney.engine.sampling.rows import SampleRequest
from whitney.engine.sampling.sampler import Sampler
from whitney.engine.training import checkpoint as ckpt
from whitney.engine.training.batch import Prepared, add_gradient, compute_pass
from whitney.engine.training.optim import NonFiniteGradient, OptimizerState, optim_step, optim_steps
from whitney.engine.training.passes import activation_bytes_per_token, default_pass_mib, plan_passes
from whitney.engine.training.requests import check_request
from whitney.engine.training.run import Run
from whitney.engine.training.sharded_checkpoint import load_sharded_run
from whitney.errors import Conflict, InvalidInput, NotFound, WhitneyError
from whitney.protocol.config import DEFAULT_MODEL, EngineConfig, check_optional_count
from whitney.protocol.sampling import SampleResult, SamplingParams
from whitney.protocol.training import AdamParams, Checked, Datum, ForwardRequest, ForwardResult, LoraConfig


class Engine:
    """Holds the loaded base models and the runs; every operation of the seeds is a method here.

    Not thread-safe: the service drives it from one worker thread. Every tensor it holds lives on `device`
    (see "Devices and compute dtype" in docs/ARCHITECTURE.md for what runs on the CPU on purpose).
    """

    def __init__(self, max_lora_rank: int = EngineConfig.max_lora_rank,
                 compute_dtype: str | torch.dtype = EngineConfig.compute_dtype,
                 max_sequences: int = EngineConfig.max_sequences, max_cached_tokens: int = EngineConfig.max_cached_tokens,
                 max_prefill_tokens: int = EngineConfig.max_prefill_tokens,
                 device: str | torch.device = EngineConfig.device,
                 page_idle_seconds: float | None = EngineConfig.page_idle_seconds,
                 max_resident_runs: int | None = EngineConfig.max_resident_runs,
                 paging_dir: str | None = EngineConfig.paging_dir,
                 max_pass_mib: int | None = EngineConfig.max_pass_mib):
        self.max_lora_rank = max_lora_rank
        self.device = resolve_device(device)  # "auto" resolved: cpu or cuda:N
        self.compute_dtype = resolve_compute_dtype(compute_dtype, self.device)  # base weights, activations
        self.max_sequences = max_sequences  # sampling: concurrent sequences per base model
        self.max_cached_tokens = max_cached_tokens  # sampling: KV-cache tokens per base model
        self.max_prefill_tokens = max_prefill_tokens  # sampling: prompt tokens prefilled per step
        check_optional_count("max_pass_mib", max_pass_mib, "the device's default")
        self.max_pass_mib = max_pass_mib or default_pass_mib(self.device)  # training: activations of one pass
        self.models: dict[str, BaseModel] = {}
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, Sampler] = {}
        self._checkpoint_adapters: dict[str, Adapter] = {}
        self.pager = Pager(self.runs, page_idle_seconds, paging_dir, max_resident_runs)  # runs to disk and back

    @property
    def compute_dtype_name(self) -> str:
        return next(name for name, dt in COMPUTE_DTYPES.items() if dt == self.compute_dtype)

    # ---- models and runs -------------------------------------------------------------------

    def load_model(self, name: str = DEFAULT_MODEL) -> BaseModel:
        """Load a base model once; later calls return the same shared weights."""
        if name not in self.models:
            self.models[name] = load_base_model(name, self.compute_dtype, self.device)
        return self.models[name]

    def create_run(self, run_id: str, base_model: str = DEFAULT_MODEL, lora: LoraConfig | None = None) -> Run:
        """A new run whose adapter equals the base model (B = 0). Costs its adapter's memory only."""
        if run_id in self.runs or run_id in self.pager.lost:  # a lost run's id is taken until it is deleted
            raise Conflict(f"run {run_id!r} already exists", field="run_id")
        base = self.load_model(base_model)
        adapter = init_adapter(base, lora or LoraConfig(), self.max_lora_rank)
        run = Run(run_id, base, adapter, {})
        self.runs[run_id] = run
        self.pager.touch(run)
        return run

    def get_run(self, run_id: str) -> Run:
        """The run, paged back in first if it was paged out (every use of a run comes through here)."""
        run = self._find_run(run_id)
        self.pager.touch(run)
        return run

    def _find_run(self, run_id: str) -> Run:
        if run_id in self.pager.lost:  # its paged-out state could not be read back (paging.py)
            raise RunStateLost(self.pager.lost[run_id])
        run = self.runs.get(run_id)
        if run is None:
            raise NotFound(f"run {run_id!r} does not exist", field="run_id")
        return run

    def delete_run(self, run_id: str) -> None:
        """Forget a run (and its page file) and give its memory back (glibc keeps freed MBs until malloc_trim)."""
        self.pager.forget(run_id)
        if self.runs.pop(run_id, None) is not None:
            release_memory()

    def page_out_idle(self) -> int:
        """Page out the runs untouched for `page_idle_seconds` (paging.py); how many."""
        return self.pager.page_out_idle()

    def take_lost_runs(self) -> list[str]:
        """Runs lost since the last call: their paged-out state could not be read back (paging.py). Each use
        of one fails with RunStateLost until it is deleted."""
        return self.pager.take_lost()

    def residency(self) -> dict:
        """Runs in memory and paged out; page-outs and page-ins so far and their seconds (any thread)."""
        return self.pager.residency(len(self.runs))

    def commit_gradients(self, run_id: str, stage: str) -> None:
        """Add a staged operation's gradient (all its micro-batches) to the run's accumulator."""
        run = self.get_run(run_id)
        for name, g in run.staged.pop(stage, {}).items():
            add_gradient(run.grads, name, g)

    def discard_gradients(self, run_id: str, stage: str) -> None:
        """Forget a staged operation's gradient (it failed or was cancelled part-way)."""
        if run_id in self.runs:
            try:
                self.get_run(run_id).staged.pop(stage, None)
            except RunStateLost:  # its state, the staged gradient with it, could not be read back: nothing to drop
                pass

    # ---- forward and forward_backward ----------------------------------------------------

    def forward(self, run_id: str | None, data: list[Datum], loss_fn: str = "cross_entropy",
                loss_config: dict | None = None, base_model: str | None = None) -> ForwardResult:
        """Loss, metrics and log-probs without gradients."""
        return self._one(ForwardRequest(run_id, data, loss_fn, loss_config or {}, base_model), backward=False)

    def forward_backward(self, run_id: str, data: list[Datum], loss_fn: str = "cross_entropy",
                         loss_config: dict | None = None) -> ForwardResult:
        """As forward, and add the loss's gradient to the run's accumulator (until the next optim_step)."""
        return self._one(ForwardRequest(run_id, data, loss_fn, loss_config or {}), backward=True)

    def _one(self, request: ForwardRequest, backward: bool) -> ForwardResult:
        (result,) = self.run_batch([request], backward)
        if isinstance(result, (WhitneyError, RunStateLost)):
            raise result
        return result

    def run_batch(self, requests: list[ForwardRequest], backward: bool
                  ) -> list[ForwardResult | WhitneyError | RunStateLost]:
        """Run several requests (of any runs) together. Invalid requests get their error; the rest run.

        The results of each request equal running it alone. Under a residency budget (paging.py) the runs go a
        budget's worth at a time, each part with its runs pinned in memory.
        """
        out: list[ForwardResult | WhitneyError | None] = [None] * len(requests)
        for part in self.pager.budget_parts([r.run_id for r in requests]):
            with self.pager.pinning({requests[i].run_id for i in part} - {None}):
                results = self._run_batch([requests[i] for i in part], backward)
            for i, result in zip(part, results):
                out[i] = result
        return out  # type: ignore[return-value]

    def _run_batch(self, requests: list[ForwardRequest], backward: bool) -> list[ForwardResult | WhitneyError]:
        out: list[ForwardResult | WhitneyError | None] = [None] * len(requests)
        by_base: dict[str, list[tuple[int, Prepared]]] = {}
        for i, request in enumerate(requests):
            try:
                prepared = self._prepare(request, backward)
            except (WhitneyError, RunStateLost) as e:  # this request alone: the others run
                out[i] = e
                continue
            by_base.setdefault((prepared.run.base if prepared.run
                                else self.load_model(request.base_model or DEFAULT_MODEL)).name,
                               []).append((i, prepared))
        for name, items in by_base.items():
            # Rows of one adapter stay contiguous (one LoRA matmul per adapter per projection), adapters in the
            # order the requests first name them: the same order in every process (the ranks of a sharded engine).
            first: dict[int, int] = {}
            for _, p in items:
                first.setdefault(id(p.adapter), len(first))
            items.sort(key=lambda x: first[id(x[1].adapter)])
            base = self.models[name]
            for part in self._passes(base, [p for _, p in items], backward):
                results = self._compute(base, [items[j][1] for j in part], backward)
                for j, result in zip(part, results):
                    out[items[j][0]] = result
        return out  # type: ignore[return-value]

    def _passes(self, base: BaseModel, items: list[Prepared], backward: bool) -> list[list[int]]:
        """A training call's requests in passes whose kept activations fit max_pass_mib (passes.py); a forward
        keeps none, so it runs as one."""
        if not backward:
            return [list(range(len(items)))]
        return plan_passes([(len(it.datums), max(d.length for d in it.datums)) for it in items],
                           self._pass_budget(base))

    def _pass_budget(self, base: BaseModel) -> int:
        """The padded tokens of one training pass whose kept activations fit max_pass_mib (passes.py)."""
        return self.max_pass_mib * 2**20 // activation_bytes_per_token(base.config, base.compute_dtype)

    def validate(self, request: ForwardRequest, backward: bool) -> Checked:
        """Check a request without running it (safe from another thread: it reads the run's base model only,
        never pages the run in; a request naming its base model too is checked on that model, whether this engine
        holds the run or not); return each datum's positions and cost (requests.CheckedRequest.checked)."""
        if request.run_id is not None and request.run_id in self.pager.lost:  # its paged-out state (paging.py)
            raise Conflict(self.pager.lost[request.run_id], field="run_id")
        base = (self._find_run(request.run_id).base if request.run_id is not None and request.base_model is None
                else self.load_model(request.base_model or DEFAULT_MODEL))
        return check_request(request, backward, base.config.vocab_size, base.config.max_context,
                             vision.expander(base)).checked()

    def image_tokens(self, base_model: str, chunks: list) -> list[int]:
        """The positions each image chunk of a prompt or scored sequence takes on `base_model`, in order: each image
        decoded and processed now, on the calling thread, and kept for the request that carries it
        (vision.ProcessedImages), so the worker thread does not decode it. InvalidInput names a chunk the model's
        processor refuses. Safe from another thread: it reads the base model only."""
        _, images = vision.expander(self.load_model(base_model)).flatten(chunks, None)
        return [im.tokens for im in images]

    def _prepare(self, request: ForwardRequest, backward: bool) -> Prepared:
        if request.run_id is None:
            run, adapter = None, None
            base = self.load_model(request.base_model or DEFAULT_MODEL)
        else:
            run = self.get_run(request.run_id)
            adapter, base = run.adapter, run.base
        checked = check_request(request, backward, base.config.vocab_size, base.config.max_context,
                                vision.expander(base))
        return Prepared(request, adapter, run, checked.datums, checked.spec, checked.config, checked.rows)

    def _compute(self, base: BaseModel, items: list[Prepared], backward: bool) -> list[ForwardResult | WhitneyError]:
        """One pass over the prepared requests (batch.py)."""
        return compute_pass(base, items, backward)

    # ---- optimizer -----------------------------------------------------------------------

    def optim_step(self, run_id: str, params: AdamParams | dict | None = None) -> dict[str, float]:
        """One AdamW step on the run's adapter from its accumulated gradients, which are then cleared. A gradient
        that is not finite is refused (NonFiniteGradient: no step, the gradient dropped; optim.py)."""
        run = self.get_run(run_id)
        hp = params if isinstance(params, AdamParams) else AdamParams.from_dict(params or {})
        hp.validate()
        self._sum_gradients([run])
        try:
            return optim_step(run.weights(), run.grads, run.optimizer, hp)
        except NonFiniteGradient as e:
            raise e.of_run(run_id) from None

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | Exception]:
        """The runs' optim_steps (each run at most once) in one multi-tensor pass (`optim.optim_steps`), each
        bitwise the run's own (a budget's worth of runs at a time under a residency budget); a refused one
        (unknown run, bad parameters, a gradient that is not finite, a run whose paged-out state was lost) gets
        its error alone."""
        out: list = [None] * len(steps)
        for part in self.pager.budget_parts([run_id for run_id, _ in steps]):
            batch, where, seen = [], [], set()
            with self.pager.pinning({steps[i][0] for i in part}):
                for i in part:
                    run_id, params = steps[i]
                    try:
                        if run_id in seen:
                            raise Conflict(f"run {run_id!r} has two optim_steps in one call", field="run_id")
                        run = self.get_run(run_id)  # pages the run in (paging.py)
                        params.validate()
                        step = (run.weights(), run.grads, run.optimizer, params)  # reads paged-out moments
                    except Exception as e:
                        out[i] = e
                        continue
                    seen.add(run_id)
                    batch.append(step)
                    where.append(i)
                self._sum_gradients([self.runs[steps[i][0]] for i in where])
                for i, metrics in zip(where, optim_steps(batch)):
                    out[i] = metrics.of_run(steps[i][0]) if isinstance(metrics, NonFiniteGradient) else metrics
        return out

    def _sum_gradients(self, runs: list[Run]) -> None:
        """Make each run's accumulator its whole gradient, right before its optim_step: a no-op in one process; a
        data-parallel engine sums its ranks' shares (engine/training/sharded.py)."""

    # ---- log-probs of given sequences ----------------------------------------------------

    def compute_logprobs(self, sequences: list[list[int]], *, run_id: str | None = None,
                         version: int | None = None, checkpoint_path: str | None = None,
                         base_model: str | None = None) -> list[list[float | None]]:
        """Per-token log-probs of each sequence under the chosen weights; the first position has none."""
        adapter, base = self.resolve_weights(run_id=run_id, version=version, checkpoint_path=checkpoint_path,
                                             base_model=base_model)
        for i, s in enumerate(sequences):
            if not isinstance(s, list) or len(s) == 0:
                raise InvalidInput(f"sequence {i} is empty", field="sequences", datum_index=i)
        expand = vision.expander(base)  # a sequence may hold image chunks (vision.logprob_datum)
        data, image_rows = zip(*(vision.logprob_datum(expand, s, i) for i, s in enumerate(sequences)))
        ce = LOSSES["cross_entropy"]
        prepared = [prepare_datum(d, i, ce.inputs, {"target_tokens"}, base.config.vocab_size,
                                  base.config.max_context, expand) for i, d in enumerate(data)]
        (result,) = self._compute(base, [Prepared(ForwardRequest(None, list(data)), adapter, None, prepared, ce, {})],
                                  backward=False)
        return [vision.sequence_logprobs(o.logprobs, im) for o, im in zip(result.outputs, image_rows)]

    def resolve_weights(self, *, run_id: str | None = None, version: int | None = None,
                        checkpoint_path: str | None = None, base_model: str | None = None
                        ) -> tuple[Adapter | None, BaseModel]:
        """The adapter and base for: a run's sampler version, a saved checkpoint, or a base model."""
        if run_id is not None:
            run = self.get_run(run_id)
            if version is None:
                raise InvalidInput("name a sampler version of the run (save_weights_for_sampler returns one)",
                                   field="version")
            if version not in run.sampler_versions:
                raise NotFound(f"run {run_id!r} has no sampler version {version}; it has "
                               f"{sorted(run.sampler_versions)}", field="version")
            return run.sampler_versions[version], run.base
        if checkpoint_path is not None:
            meta = ckpt.read_manifest(checkpoint_path)
            # Keyed by content too: a checkpoint deleted and saved again at the same path is reloaded.
            key = f"{checkpoint_path}:{meta['sha256']['adapter.safetensors']}"
            base = self.load_model(meta["base_model"])
            if key not in self._checkpoint_adapters:
                adapter = init_adapter(base, LoraConfig.from_dict(meta["lora"]), self.max_lora_rank)
                ckpt.load_into(checkpoint_path, adapter, None, base.name)
                self._checkpoint_adapters[key] = copy_adapter(adapter)
            return self._checkpoint_adapters[key], base
        return None, self.load_model(base_model or DEFAULT_MODEL)

    # ---- sampling ------------------------------------------------------------------------

    def submit_sample(self, prompt: list[int], params: SamplingParams, *, run_id: str | None = None,
                      version: int | None = None, checkpoint_path: str | None = None,
                      base_model: str | None = None) -> SampleRequest:
        """Queue a sampling request on the chosen weights; `sample_step` advances it. Never sees newer weights."""
        adapter, base = self.resolve_weights(run_id=run_id, version=version, checkpoint_path=checkpoint_path,
                                             base_model=base_model)
        if base.name not in self.samplers:
            self.samplers[base.name] = Sampler(base, self.max_sequences, self.max_cached_tokens,
                                               self.max_prefill_tokens)
        request = self.samplers[base.name].submit(prompt, params, adapter)
        if run_id is not None:
            self.pager.hold(run_id, request)  # the run stays in memory until the request ends
        return request

    def sample_step(self) -> bool:
        """One admit + decode step on every base model with sampling work; False when all are idle."""
        busy = [s for s in self.samplers.values() if not s.idle]
        for sampler in busy:
            sampler.step()
        return bool(busy)

    def reset_sampling(self) -> None:
        """Drop every queued and running sampling request (after a failure left a sampler inconsistent)."""
        self.samplers.clear()
        self.pager.holds.clear()

    def sample(self, prompt: list[int], params: SamplingParams | None = None, **weights) -> SampleResult:
        """Submit one request and step until it is done (other queued requests advance too)."""
        request = self.submit_sample(prompt, params or SamplingParams(), **weights)
        while not request.done:
            self.sample_step()
        if request.error is not None:
            raise request.error
        return request.result

    # ---- snapshots, checkpoints and exports ----------------------------------------------

    def save_weights_for_sampler(self, run_id: str) -> int:
        """Freeze a copy of the run's adapter as the next sampler version (1, 2, ...)."""
        run = self.get_run(run_id)
        version = max(run.sampler_versions, default=0) + 1
        run.sampler_versions[version] = copy_adapter(run.adapter)
        return version

    def save_version(self, run_id: str, version: int, path: str) -> dict:
        """Write a sampler version's frozen adapter at `path` (a state checkpoint without optimizer)."""
        run = self.get_run(run_id)
        if version not in run.sampler_versions:
            raise NotFound(f"run {run_id!r} has no sampler version {version}", field="version")
        return ckpt.save_state(path, run.sampler_versions[version], None, run.base.name)

    def save_state(self, run_id: str, path: str, include_optimizer: bool = True) -> dict:
        """Checkpoint the adapter (and optimizer) atomically at `path`; returns the manifest."""
        run = self.get_run(run_id)
        return ckpt.save_state(path, run.adapter, run.optimizer if include_optimizer else None, run.base.name)

    def load_state(self, run_id: str, path: str, with_optimizer: bool = False) -> None:
        """Restore weights (fresh optimizer) or weights and optimizer. Gradients are cleared. A checkpoint
        written by several ranks (engine/sharded.py) loads too, onto this engine's ranks or this process."""
        run = self.get_run(run_id)
        if ckpt.is_sharded(path):
            return load_sharded_run(run, path, with_optimizer)
        optimizer = ckpt.load_into(path, run.adapter, OptimizerState() if with_optimizer else None, run.base.name)
        run.optimizer = optimizer if with_optimizer else OptimizerState()
        run.grads.clear()

    def export_lora(self, run_id: str, path: str) -> None:
        """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""
        run = self.get_run(run_id)
        ckpt.export_peft(path, run.adapter, run.base)

    def save_weights(self, run_id: str, path: str, merge: bool = False) -> None:
        """merge: a standalone Hugging Face model with the adapter merged in; else the adapter alone."""
        run = self.get_run(run_id)
        if merge:
            ckpt.export_merged(path, run.adapter, run.base)
        else:
            ckpt.export_peft(path, run.adapter, run.base)

