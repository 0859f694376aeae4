"""The training operations that are neither a forward nor an optim_step: load_state and the saves
(save_state, save_weights, export_lora, save_weights_for_sampler), each one backend call and, for a save,
the model package it wrote registered in the store. Run by the scheduler's worker thread in seq_id order."""

from __future__ import annotations

from pathlib import Path

from whitney.errors import InvalidInput
from whitney.protocol.backend import Backend, PackageKind
from whitney.service.scheduling.jobs import LoadJob, SaveJob
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind
from whitney.service.store.records import OperationRecord
from whitney.service.store.tables import new_id


# Each save operation and the package it writes (save_weights with merge writes a merged one).
SAVES = {OperationKind.SAVE_STATE: PackageKind.STATE, OperationKind.SAVE_WEIGHTS: PackageKind.WEIGHTS,
         OperationKind.EXPORT_LORA: PackageKind.LORA, OperationKind.SAVE_WEIGHTS_FOR_SAMPLER: PackageKind.SAMPLER}


def execute(backend: Backend, store: Store, data_dir: Path, op: OperationRecord, job: LoadJob | SaveJob) -> dict:
    """Run a load or a save of `op`'s run; its result as stored (the checkpoint, or the public package)."""
    run_id, kind = op.run_id, op.kind
    if isinstance(job, LoadJob):
        backend.load_state(run_id, job.path, with_optimizer=kind == OperationKind.LOAD_STATE_WITH_OPTIMIZER)
        return {"checkpoint_id": job.checkpoint_id}
    run = store.get_run(run_id)
    package_id = new_id("pkg")
    path = str(Path(data_dir) / "packages" / package_id)
    package_kind = SAVES.get(kind)
    if package_kind is None:
        raise InvalidInput(f"unknown operation kind {kind!r}", field="kind")
    if package_kind == PackageKind.WEIGHTS and job.merge:
        package_kind = PackageKind.MERGED
    include_optimizer = package_kind == PackageKind.STATE and job.include_optimizer
    # A sampler version is also on disk, so it outlives the run and a restart (and reaches every sampler worker).
    version = backend.save(run_id, package_kind, path, include_optimizer=include_optimizer)
    name = job.name or (str(version) if package_kind == PackageKind.SAMPLER else None)
    package = store.register_package(run_id, run.owner, package_kind, name, path, run.base_model,
                                     include_optimizer, package_id)
    if package_kind == PackageKind.SAMPLER:
        return {"version": version, "package": package.shown()}
    return {"package": package.shown()}
