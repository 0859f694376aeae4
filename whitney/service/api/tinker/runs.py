"""Tinker's REST reads: training runs, their checkpoints (list, delete), weights info, all checkpoints."""

from __future__ import annotations


from whitney.errors import NotFound
from whitney.protocol.backend import PackageKind
from whitney.service.api.tinker.common import (KIND_SEGMENT, SEGMENT_KIND, TinkerBody, checkpoint, iso, packages_named,
                                               resolve_path)
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.store.lifecycle import RunStatus
from whitney.service.store.records import PackageRecord, RunRecord
from whitney.service.store.packages import remove

router = new_router()


def _newest_per_name(packages: list[PackageRecord]) -> list[PackageRecord]:
    """One checkpoint per (kind, name): its newest version, as a tinker:// path names it."""
    newest: dict[tuple[str, str], PackageRecord] = {}
    for p in packages:
        if p.kind in KIND_SEGMENT:
            key = (p.kind, p.name)
            if key not in newest or p.version > newest[key].version:
                newest[key] = p
    return sorted(newest.values(), key=lambda p: p.created_at)


def training_run(st: ServiceState, who: str, run: RunRecord) -> dict:
    packages = _newest_per_name(st.store.list_packages(who, run.id))
    last = {kind: next((checkpoint(p) for p in reversed(packages) if p.kind == kind), None)
            for kind in (PackageKind.STATE, PackageKind.SAMPLER)}
    times = [run.created_at] + [p.created_at for p in packages]
    metadata = {k: v for k, v in (run.user_metadata or {}).items()}
    return {"training_run_id": run.id, "base_model": run.base_model, "model_owner": who or "local",
            "is_lora": True, "corrupted": run.status == RunStatus.FAILED, "lora_rank": run.lora["rank"],
            "last_request_time": iso(max(times)), "last_checkpoint": last[PackageKind.STATE],
            "last_sampler_checkpoint": last[PackageKind.SAMPLER], "user_metadata": metadata}


@router.get("/training_runs")
def list_training_runs(st: State, who: Owner, limit: int = 20, offset: int = 0) -> dict:
    runs = st.store.list_runs(who)
    page = runs[offset:offset + limit]
    return {"training_runs": [training_run(st, who, r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, st: State, who: Owner) -> dict:
    return training_run(st, who, st.store.get_run(run_id, who))


@router.get("/training_runs/{run_id}/checkpoints")
def list_checkpoints(run_id: str, st: State, who: Owner) -> dict:
    st.store.get_run(run_id, who)
    return {"checkpoints": [checkpoint(p) for p in _newest_per_name(st.store.list_packages(who, run_id))]}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, st: State, who: Owner) -> dict:
    """checkpoint_id is `weights/{name}` or `sampler_weights/{name}`: every version of that name goes."""
    segment, _, name = checkpoint_id.partition("/")
    found = packages_named(st, who, run_id, SEGMENT_KIND[segment], name) if segment in SEGMENT_KIND and name else []
    if not found:
        raise NotFound(f"training run {run_id!r} has no checkpoint {checkpoint_id!r}", field="checkpoint_id")
    for package in found:  # a Conflict while one is being read (packages.remove)
        remove(st.store, package.id, who)
    return {}


@router.get("/checkpoints")
def list_user_checkpoints(st: State, who: Owner, limit: int = 100, offset: int = 0) -> dict:
    packages = _newest_per_name(st.store.list_packages(who))
    page = packages[offset:offset + limit]
    return {"checkpoints": [checkpoint(p) for p in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(packages)}}


class WeightsInfo(TinkerBody):
    tinker_path: str


@router.post("/weights_info")
def weights_info(body: WeightsInfo, st: State, who: Owner) -> dict:
    package = resolve_path(st, who, body.tinker_path)
    lora = st.store.get_run(package.run_id).lora
    return {"base_model": package.base_model, "is_lora": True, "lora_rank": lora["rank"],
            "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn")}
