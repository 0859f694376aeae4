"""The training operations that are neither a forward nor an optim_step: load_state and the saves
(save_state, save_weights, export_lora, save_weights_for_sampler), each one backend call and, for a save,
the model package it wrote registered in the store. Run by the scheduler's worker thread in seq_id order."""

from __future__ import annotations

from pathlib import Path

from whitney.errors import InvalidInput
from whitney.protocol.backend import Backend
from whitney.service.scheduling.jobs import LoadJob, SaveJob, public_package
from whitney.service.store.database import Store, new_id
from whitney.service.store.lifecycle import OperationKind


def execute(backend: Backend, store: Store, data_dir: Path, op: dict, job: LoadJob | SaveJob) -> dict:
    """Run a load or a save of `op`'s run; its result as stored (the checkpoint, or the public package)."""
    run_id, kind = op["run_id"], op["kind"]
    if isinstance(job, LoadJob):
        backend.load_state(run_id, job.path, with_optimizer=kind == OperationKind.LOAD_STATE_WITH_OPTIMIZER)
        return {"checkpoint_id": job.checkpoint_id}
    run = store.get_run(run_id)
    package_id = new_id("pkg")
    path = str(Path(data_dir) / "packages" / package_id)
    if kind == OperationKind.SAVE_STATE:
        backend.save_state(run_id, path, include_optimizer=job.include_optimizer)
        package = store.register_package(run_id, run["owner"], "state", job.name, path,
                                         run["base_model"], job.include_optimizer, package_id)
    elif kind == OperationKind.SAVE_WEIGHTS:
        backend.save_weights(run_id, path, merge=job.merge)
        package = store.register_package(run_id, run["owner"], "merged" if job.merge else "weights",
                                         job.name, path, run["base_model"], False, package_id)
    elif kind == OperationKind.EXPORT_LORA:
        backend.export_lora(run_id, path)
        package = store.register_package(run_id, run["owner"], "lora", job.name, path,
                                         run["base_model"], False, package_id)
    elif kind == OperationKind.SAVE_WEIGHTS_FOR_SAMPLER:
        # Also on disk, so the version outlives the run and a restart (and reaches every sampler worker).
        version = backend.save_weights_for_sampler(run_id, path)
        package = store.register_package(run_id, run["owner"], "sampler", job.name or str(version),
                                         path, run["base_model"], False, package_id)
        return {"version": version, "package": public_package(package)}
    else:
        raise InvalidInput(f"unknown operation kind {kind!r}", field="kind")
    return {"package": public_package(package)}
