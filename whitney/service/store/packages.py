"""Model packages after they are written: expiry and the reaper, readers, publishing, copies, user metadata.

Rules that must survive races are single conditional UPDATEs on the package's row:
  - a reader (a load_state, a run resumed from it, a sample or log-prob request on it, a download, a copy)
    counts itself in `readers` with `UPDATE ... SET readers = readers + 1 WHERE NOT deleted AND NOT expired`;
  - the reaper and a delete mark a package deleted only `WHERE readers = 0`.
Both write the same row, so on SQLite (one writer at a time) and on PostgreSQL (the second UPDATE re-checks its
WHERE on the row the first committed) exactly one wins: a package is never deleted under a load in progress,
and a load never starts on a package being deleted. Readers are reset at start (no load outlives its process).

Visibility: a package is its owner's; a public one is readable (load, sample, download, copy) by every key,
never writable (delete, TTL, publish, metadata) by another. Past its `expires_at` a package reads 404 at
once, and the reaper (the scheduler's idle tick, every few seconds) removes its files and its row.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from sqlalchemy import delete, or_, select, update

from whitney.errors import Conflict, InvalidInput, NotFound
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationStatus
from whitney.service.store.records import OperationRecord, PackageRecord, record
from whitney.service.store.tables import PackageRow, new_id

MAX_TTL_SECONDS = 10 * 365 * 24 * 3600  # Tinker's upper bound (its lower one, an hour, is not enforced here)


def check_ttl(ttl_seconds: int | None, field: str = "ttl_seconds") -> None:
    if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int)
                                    or not 1 <= ttl_seconds <= MAX_TTL_SECONDS):
        raise InvalidInput(f"ttl_seconds must be an integer from 1 to {MAX_TTL_SECONDS} (10 years), or null for no "
                           f"expiry; got {ttl_seconds!r}", field=field)


def _live():
    """Not deleted and not past its expiry (the condition every read and reader takes)."""
    return PackageRow.deleted.is_(False), or_(PackageRow.expires_at.is_(None), PackageRow.expires_at > time.time())


# ---- ownership and settings ----------------------------------------------------------------------

def owned(store: Store, package_id: str, who: str) -> PackageRecord:
    """The caller's own live package (a public package of another key is not writable: 404, as unknown)."""
    package = store.get_package(package_id, who)
    if package.owner != who:
        raise NotFound(f"model package {package_id!r} does not exist", field="checkpoint_id")
    return package


def readable(store: Store, package_id: str, who: str, also: str | None = None) -> PackageRecord:
    """A live package the caller may read: its own, a public one, or one of `also` (the owner of a second key
    the caller presented: it holds both)."""
    try:
        return store.get_package(package_id, who)
    except NotFound:
        if also is None:
            raise
    return store.get_package(package_id, also)


def settle(store: Store, package_id: str, who: str, *, ttl_seconds: int | None = None, clear_ttl: bool = False,
           user_metadata: dict | None = None) -> PackageRecord:
    """Set (or with clear_ttl remove) the package's expiry, counted from now, and/or replace its user_metadata."""
    owned(store, package_id, who)
    check_ttl(ttl_seconds)
    values: dict = {}
    if ttl_seconds is not None or clear_ttl:
        values["expires_at"] = None if ttl_seconds is None else time.time() + ttl_seconds
    if user_metadata is not None:
        values["user_metadata"] = user_metadata
    if values:
        with store.tx() as db:
            db.execute(update(PackageRow).where(PackageRow.id == package_id).values(**values))
    return store.get_package(package_id, who)


def settle_at_end(store: Store, op_id: str, ttl_seconds: int | None, user_metadata: dict | None) -> None:
    """Give the package a save operation writes its expiry and user_metadata as the operation succeeds (its
    result shows them). Checked now, so a bad TTL is refused before anything is queued."""
    check_ttl(ttl_seconds)
    if ttl_seconds is None and not user_metadata:
        return

    def apply(status: str, result: dict | None) -> dict | None:
        package = (result or {}).get("package")
        if status != OperationStatus.SUCCEEDED or not package:
            return result
        values = {"user_metadata": user_metadata or None,
                  "expires_at": None if ttl_seconds is None else time.time() + ttl_seconds}
        with store.tx() as db:
            db.execute(update(PackageRow).where(PackageRow.id == package["id"]).values(**values))
        return {**result, "package": {**package, **values}}

    store.at_end[op_id] = apply


def publish(store: Store, package_id: str, who: str, public: bool) -> PackageRecord:
    """Make the caller's package readable by every key (or its own again); Conflict if it already is."""
    owned(store, package_id, who)
    with store.tx() as db:
        moved = db.execute(update(PackageRow).where(PackageRow.id == package_id, PackageRow.public.is_(not public))
                           .values(public=public)).rowcount
    if not moved:
        raise Conflict(f"checkpoint {package_id!r} is already {'public' if public else 'private'}",
                       field="checkpoint_id")
    return store.get_package(package_id, who)


# ---- readers, deletes and the reaper ---------------------------------------------------------------

def acquire(store: Store, path: str) -> bool:
    """Count one reader of the live package stored at `path`; False if it has gone (deleted or expired)."""
    with store.tx() as db:
        return db.execute(update(PackageRow).where(PackageRow.path == path, *_live())
                          .values(readers=PackageRow.readers + 1)).rowcount == 1


def release(store: Store, path: str) -> None:
    with store.tx() as db:
        db.execute(update(PackageRow).where(PackageRow.path == path, PackageRow.readers > 0)
                   .values(readers=PackageRow.readers - 1))


def release_at_end(store: Store, op_id: str, path: str) -> None:
    """The operation's reader of the package at `path` released as it ends (in the process that ends it)."""
    store.at_end[op_id] = lambda status, result: (release(store, path), result)[1]


def gone(path: str) -> NotFound:
    return NotFound(f"the checkpoint at {Path(path).name} has expired or was deleted", field="checkpoint_id")


def reading(store: Store, path: str | None,
            submit: Callable[[], tuple[OperationRecord, bool]]) -> tuple[OperationRecord, bool]:
    """submit() an operation that reads the package at `path` (None: no package), counted as its reader from
    before it is recorded until it ends (Store.at_end), so the reaper and deletes wait for it.
    NotFound if the package has gone since the route looked it up."""
    if path is None:
        return submit()
    if not acquire(store, path):
        raise gone(path)
    try:
        op, created = submit()
    except BaseException:
        release(store, path)
        raise
    if created and op.status == OperationStatus.QUEUED:
        release_at_end(store, op.id, path)
    else:  # a retry of an operation recorded before: its own reader, if any, is counted already
        release(store, path)
    return op, created


class Reading:
    """`with Reading(store, path):` reads the package's files in this thread (a resume, a download, a copy)."""

    def __init__(self, store: Store, path: str):
        self.store, self.path = store, path

    def __enter__(self) -> str:
        if not acquire(self.store, self.path):
            raise gone(self.path)
        return self.path

    def __exit__(self, *exc) -> None:
        release(self.store, self.path)


def remove(store: Store, package_id: str, who: str) -> PackageRecord:
    """Delete the caller's package and its files; Conflict while a load of it is in progress."""
    package = owned(store, package_id, who)
    with store.tx() as db:
        moved = db.execute(update(PackageRow).where(PackageRow.id == package_id, PackageRow.deleted.is_(False),
                                                    PackageRow.readers == 0).values(deleted=True)).rowcount
    if not moved:
        raise Conflict(f"checkpoint {package_id!r} is being read (a load, sample or download in progress); "
                       "delete it once that has ended", field="checkpoint_id")
    shutil.rmtree(package.path, ignore_errors=True)
    return package


def reap(store: Store, now: float | None = None) -> list[str]:
    """Delete every package past its expiry that no one reads: marked deleted (one conditional UPDATE), then
    its files, then its row. Returns their ids. An expired package being read waits for the next tick."""
    now = time.time() if now is None else now
    with store.tx() as db:
        expired = db.execute(update(PackageRow).where(
            PackageRow.deleted.is_(False), PackageRow.expires_at.is_not(None), PackageRow.expires_at <= now,
            PackageRow.readers == 0).values(deleted=True).returning(PackageRow.id, PackageRow.path)).all()
    for _, path in expired:
        shutil.rmtree(path, ignore_errors=True)
    if expired:
        with store.tx() as db:
            db.execute(delete(PackageRow).where(PackageRow.id.in_([i for i, _ in expired])))
    return [i for i, _ in expired]


# ---- copies ----------------------------------------------------------------------------------------

def copy(store: Store, source: PackageRecord, who: str, run_id: str, name: str | None = None,
         ttl_seconds: int | None = None) -> PackageRecord:
    """A new package of `run_id` (the caller's) with the source's kind and files: hard links where the file
    system allows (no bytes duplicated; each copy is deleted on its own), else a byte copy. The source's
    expiry is not inherited; its user_metadata is."""
    check_ttl(ttl_seconds)
    store.get_run(run_id, who)
    package_id = new_id("pkg")
    target = Path(source.path).parent / package_id
    with Reading(store, source.path):
        try:
            shutil.copytree(source.path, target, copy_function=_link_or_copy)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
    package = store.register_package(run_id, who, source.kind, name or source.name, str(target),
                                     source.base_model, source.has_optimizer, package_id)
    values = {"user_metadata": source.user_metadata,
              "expires_at": None if ttl_seconds is None else time.time() + ttl_seconds}
    with store.tx() as db:
        db.execute(update(PackageRow).where(PackageRow.id == package.id).values(**values))
    return replace(package, **values)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def size_bytes(package: PackageRecord) -> int | None:
    """Bytes of the package's files (None once they are gone)."""
    root = Path(package.path)
    if not root.is_dir():
        return None
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def files(package: PackageRecord) -> list[str]:
    """The package's files, relative to its directory, sorted."""
    root = Path(package.path)
    return sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())


def public_packages(store: Store) -> list[PackageRecord]:
    """Every live public package, oldest first."""
    with store.tx() as db:
        rows = db.scalars(select(PackageRow).where(PackageRow.public.is_(True), *_live())
                          .order_by(PackageRow.created_at))
        return [record(PackageRecord, r) for r in rows]
