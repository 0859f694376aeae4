"""Model packages: saved states, sampler versions and exports, listed, fetched, deleted, downloaded; their
expiry, user metadata, publishing and copies (packages.py holds the rules)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

from fastapi import Header, Request
from fastapi.responses import Response

from whitney.errors import NotFound
from whitney.service.api.native import schemas
from whitney.service.http import downloads, signing
from whitney.service.http.deps import Owner, State, new_router
from whitney.service.scheduling.limits import check_metadata
from whitney.service.store import packages
from whitney.service.store.records import PackageRecord

router = new_router(prefix="/v1", tags=["checkpoints"])
URL_SECONDS = 3600  # how long a signed download URL works


@router.get("/checkpoints", response_model=list[schemas.Package])
def list_checkpoints(st: State, who: Owner, run_id: str | None = None, kind: str | None = None,
                     public: bool = False):
    """The caller's packages (or, with public=true, every key's public ones), oldest first."""
    if public:
        return [p for p in packages.public_packages(st.store) if run_id in (None, p.run_id)
                and kind in (None, p.kind)]
    return st.store.list_packages(who, run_id, kind)


@router.get("/checkpoints/{package_id}", response_model=schemas.Package)
def get_checkpoint(package_id: str, st: State, who: Owner):
    return st.store.get_package(package_id, who)


@router.patch("/checkpoints/{package_id}", response_model=schemas.Package, status_code=200)
def update_checkpoint(package_id: str, body: schemas.PackageUpdate, st: State, who: Owner):
    """Set the expiry (`ttl_seconds` from now; null removes it) and/or replace the user_metadata."""
    if body.user_metadata is not None:
        check_metadata(st.limits, body.user_metadata)  # bounded depth and size, before it is stored
    return packages.settle(st.store, package_id, who, ttl_seconds=body.ttl_seconds,
                           clear_ttl="ttl_seconds" in body.model_fields_set and body.ttl_seconds is None,
                           user_metadata=body.user_metadata)


@router.delete("/checkpoints/{package_id}", response_model=schemas.Package)
def delete_checkpoint(package_id: str, st: State, who: Owner):
    """Forget a package; its files are removed. A run bound to it keeps what it already loaded. 409 while a
    load, sample or download of it is in progress."""
    return packages.remove(st.store, package_id, who)


@router.post("/checkpoints/{package_id}/publish", response_model=schemas.Package)
def publish_checkpoint(package_id: str, st: State, who: Owner):
    """Readable by every key from now on (load, sample, download, copy); only its owner may change it."""
    return packages.publish(st.store, package_id, who, True)


@router.delete("/checkpoints/{package_id}/publish", response_model=schemas.Package)
def unpublish_checkpoint(package_id: str, st: State, who: Owner):
    return packages.publish(st.store, package_id, who, False)


@router.post("/checkpoints/{package_id}/copy", response_model=schemas.Package, status_code=201)
def copy_checkpoint(package_id: str, body: schemas.PackageCopy, st: State, who: Owner,
                    x_source_key: Annotated[str | None, Header()] = None):
    """Copy a package into one of the caller's runs: its own, a public one, or one of the key given in
    X-Source-Key (the caller holds both keys)."""
    also = st.keys.owner(x_source_key) if x_source_key else None
    source = packages.readable(st.store, package_id, who, also)
    return packages.copy(st.store, source, who, body.run_id, body.name, body.ttl_seconds)


@router.get("/checkpoints/{package_id}/archive", response_class=Response,
            responses={200: {"content": {"application/x-tar": {}}}})
def download_checkpoint(package_id: str, st: State, who: Owner):
    """The package directory as a tar archive (a PEFT adapter, a merged model, or a saved state)."""
    package = st.store.get_package(package_id, who)
    name = f"{package.name}-v{package.version}"  # streamed as its files are read (http/downloads.py)
    return downloads.archive(st.store, package.path, name, f"{name}.tar")


def signed_urls(request: Request, package: PackageRecord) -> dict:
    """A signed URL per file of the package: GET it with no key until `expires_at` (unix seconds)."""
    package_id, expires = package.id, int(time.time()) + URL_SECONDS
    base = f"{request.url.scheme}://{request.url.netloc}/v1/signed/checkpoints/{package_id}/{expires}"
    return {"urls": {f: f"{base}/{signing.sign(f'{package_id}/{expires}/{f}')}/{f}" for f in packages.files(package)},
            "expires_at": float(expires)}


@router.get("/checkpoints/{package_id}/files", response_model=schemas.PackageFiles)
def checkpoint_files(package_id: str, request: Request, st: State, who: Owner):
    """Signed download URLs, one per file (a PEFT adapter's adapter_config.json and safetensors, ...)."""
    return signed_urls(request, st.store.get_package(package_id, who))


@router.get("/signed/checkpoints/{package_id}/{expires}/{signature}/{path:path}", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}})
def signed_file(package_id: str, expires: int, signature: str, path: str, st: State):
    """One file of a package, by a URL from /files: no key needed, the signature is the permission."""
    if expires < time.time() or not signing.verify(f"{package_id}/{expires}/{path}", signature):
        raise NotFound("this download URL has expired or is not valid; ask for a new one", field="signature")
    package = st.store.get_package(package_id)
    if path not in packages.files(package):
        raise NotFound(f"no file {path!r} in the package", field="path")
    return downloads.one_file(st.store, package.path, path, Path(path).name)  # streamed (http/downloads.py)
