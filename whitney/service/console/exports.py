"""Export a saved checkpoint as a PEFT LoRA package, from the console.

The run's own `export_lora` is an operation in its seq_id order, which the client driving the run owns;
the console must not take a seq_id from under it. So a `state` or `sampler` package is exported on its
own: on the scheduler's worker thread (the one that drives the backend), a throwaway adapter is created
from the package, exported as the engine's `export_lora` writes it, and dropped. The new package is a
`lora` package of the same run, named `<name>-v<version>`, listed and downloaded like any other.
"""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from whitney.errors import InvalidInput, NotFound
from whitney.protocol.backend import PackageKind
from whitney.protocol.training import LoraConfig
from whitney.service.http.deps import ServiceState
from whitney.service.store.records import PackageRecord
from whitney.service.store.tables import new_id

EXPORTABLE = ("state", "sampler")


async def export_peft(st: ServiceState, owner: str, package_id: str) -> PackageRecord:
    """Write the package's adapter as a PEFT LoRA directory and register it; answers the new package. The store's
    reads and writes run on the thread pool, the export on the scheduler's thread: none on the event loop."""
    package, lora = await run_in_threadpool(_exportable, st, owner, package_id)
    new_package, scratch = new_id("pkg"), new_id("export")
    path = str(st.data_dir / "packages" / new_package)
    backend = st.scheduler.backend

    def export() -> None:
        backend.create_run(scratch, package.base_model, lora, package.path)
        try:
            backend.save(scratch, PackageKind.LORA, path)
        finally:
            backend.delete_run(scratch)

    await asyncio.wrap_future(st.scheduler.call(export))
    return await run_in_threadpool(st.store.register_package, package.run_id, owner, PackageKind.LORA,
                                   f"{package.name}-v{package.version}", path, package.base_model, False,
                                   new_package)


def _exportable(st: ServiceState, owner: str, package_id: str) -> tuple[PackageRecord, LoraConfig]:
    """The caller's package, if it is one to export, and its run's LoRA config."""
    package = st.store.get_package(package_id, owner)
    if package.owner != owner:  # another key's public package: readable, but not the caller's to add to
        raise NotFound(f"model package {package_id!r} does not exist", field="checkpoint_id")
    if package.kind not in EXPORTABLE:
        raise InvalidInput(f"checkpoint {package_id} is a {package.kind} package; only state and sampler "
                           "packages are exported (the others are exports already)", field="checkpoint_id")
    return package, LoraConfig.from_dict(st.store.get_run(package.run_id).lora)
