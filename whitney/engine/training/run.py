"""One run's state: its adapter, accumulated gradients, AdamW state and sampler versions (the Engine holds
them, training/runs.py; the pager moves them to disk and back, memory/paging.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whitney.engine.families.decoder import BaseModel
from whitney.engine.families.lora import Adapter
from whitney.engine.memory.page_file import PagedMoments
from whitney.engine.training.optim import OptimizerState


@dataclass
class Run:
    """One training job: its adapter, accumulated gradients, optimizer state and sampler versions.

    `grads` holds a tensor per weight only between a forward_backward and the optim_step that consumes
    it; an idle run costs its adapter and (once it has stepped) its two AdamW moments. `staged` holds
    the gradients of an operation that runs in several micro-batches until its last one succeeded
    (`Engine.commit_gradients`), so an operation adds its gradient whole or not at all. While the run is
    paged out (paging.py) all of these are on disk (adapter and optimizer None): reach it by `Engine.get_run`.
    A paged-in run's AdamW moments stay in their file until `optimizer` is first read (a forward or a
    forward_backward does not need them).
    """

    run_id: str
    base: BaseModel
    adapter: Adapter
    grads: dict[str, torch.Tensor]
    sampler_versions: dict[int, Adapter] = field(default_factory=dict)
    staged: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage -> weight name -> grad
    optimizer_state: OptimizerState | PagedMoments | None = field(default_factory=OptimizerState)  # as it is

    @property
    def optimizer(self) -> OptimizerState:
        """AdamW's state, read back first if it is still in its page file."""
        if isinstance(self.optimizer_state, PagedMoments):
            self.optimizer_state = self.optimizer_state.read(self.base.device)
        return self.optimizer_state  # type: ignore[return-value]  # None only while paged out

    @optimizer.setter
    def optimizer(self, value: OptimizerState) -> None:
        if isinstance(self.optimizer_state, PagedMoments):
            self.optimizer_state.discard()
        self.optimizer_state = value

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.adapter.named_parameters())
