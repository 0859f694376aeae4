"""Model packages: saved states, sampler versions and exports, listed, fetched, deleted, downloaded."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from whitney.service import schemas
from whitney.service.deps import Owner, State

router = APIRouter(prefix="/v1", tags=["checkpoints"])


@router.get("/checkpoints", response_model=list[schemas.Package])
def list_checkpoints(st: State, who: Owner, run_id: str | None = None, kind: str | None = None):
    return st.store.list_packages(who, run_id, kind)


@router.get("/checkpoints/{package_id}", response_model=schemas.Package)
def get_checkpoint(package_id: str, st: State, who: Owner):
    return st.store.get_package(package_id, who)


@router.delete("/checkpoints/{package_id}", response_model=schemas.Package)
def delete_checkpoint(package_id: str, st: State, who: Owner):
    """Forget a package; its files are removed. A run bound to it keeps what it already loaded."""
    import shutil

    package = st.store.delete_package(package_id, who)
    shutil.rmtree(package["path"], ignore_errors=True)
    return package


@router.get("/checkpoints/{package_id}/archive", response_class=Response,
            responses={200: {"content": {"application/x-tar": {}}}})
def download_checkpoint(package_id: str, st: State, who: Owner):
    """The package directory as a tar archive (a PEFT adapter, a merged model, or a saved state)."""
    package = st.store.get_package(package_id, who)
    root = Path(package["path"])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(root, arcname=f"{package['name']}-v{package['version']}")
    return Response(buf.getvalue(), media_type="application/x-tar", headers={
        "Content-Disposition": f'attachment; filename="{package["name"]}-v{package["version"]}.tar"'})
