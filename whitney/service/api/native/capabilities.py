"""What this server offers: models, operations, losses, limits, features; the caller's quota; a health check."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import Header, Response
from prometheus_client import CONTENT_TYPE_LATEST

from whitney.protocol.backend import ExactOnly
from whitney.service.http.deps import Owner, State, new_router, presented_key
from whitney.service.store.lifecycle import SAMPLING_KINDS, TRAINING_KINDS

router = new_router(prefix="/v1", tags=["capabilities"])
health = new_router(tags=["health"])


@router.get("/training/capabilities")
def capabilities(st: State) -> dict:
    config = st.scheduler.backend.config
    losses = st.scheduler.backend.losses()  # the engine's loss table, as plain data
    return {
        "models": [{
            "name": name,
            "context_length": info.max_context,
            "vocab_size": info.vocab_size,
            "trainable": True,
            "sampleable": True,
            "max_lora_rank": config.max_lora_rank,
            "compute_dtype": info.compute_dtype,
            "device": info.device,
            "compute_threads": info.compute_threads,  # of the process that trains it (whitney serve --threads)
            "adaptable_modules": list(info.adaptable_modules),
            "vision": getattr(info, "vision", False),  # takes image chunks (limits: max_image_* below)
            # What serves its samples: "whitney" (exact: the trainer's model code), or "vllm"
            # (replicas; what vLLM cannot do exactly goes to Whitney's sampler, listed in exact_sampler_for).
            "sampler_engine": info.sampler_engine,
            "exact_sampler_for": [e.value for e in ExactOnly] if info.sampler_engine == "vllm" else [],
        } for name, info in ((name, st.model_info(name)) for name in st.models)],
        "operations": [*TRAINING_KINDS, *SAMPLING_KINDS],
        "loss_functions": {name: list(loss["config"]) for name, loss in losses.items()},
        "losses": {name: {k: loss[k] for k in ("required_inputs", "optional_inputs", "config", "passes")}
                   for name, loss in losses.items()},
        "limits": {
            **st.limits.as_dict(),
            "max_concurrent_sequences": config.max_sequences,
            "max_cached_tokens": config.max_cached_tokens,
        },
        "features": {"gradient_scale_v1": True, "lora_plus": True, "soft_targets": True, "opsd": True,
                     "image_asset_pointers": bool(st.limits.image_dirs)},
        # Live runs in memory and paged out to disk (idle for page_idle_seconds, or pushed out by the budget of
        # max_resident_runs; None: never).
        "runs": {**_residency(st), "page_idle_seconds": config.page_idle_seconds,
                 "max_resident_runs": config.max_resident_runs},
    }


def _residency(st) -> dict:
    residency = st.scheduler.backend.residency()
    return {"in_memory": residency.in_memory, "paged_out": residency.paged_out}


@router.get("/quota")
def quota(st: State, who: Owner) -> dict:
    """The caller's per-key limits (0: unlimited) and what it holds against each now (max_runs: runs...)."""
    return {"limits": asdict(st.quotas.limits(who)), "usage": st.quotas.usage(who)}


@health.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def metrics(st: State, authorization: Annotated[str | None, Header()] = None,
            x_api_key: Annotated[str | None, Header()] = None) -> Response:
    """Prometheus metrics (whitney.service.http.metrics), server-wide, for the operator: with API keys on, only
    the metrics key (`whitney serve --metrics-key`) reads them, never a tenant's key."""
    st.metrics.check_scraper(presented_key(authorization, x_api_key), bool(st.keys.required()))
    return Response(st.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)


@health.get("/healthz")
def healthz(st: State) -> dict:
    """Answers without an API key. A member of a highly available service adds its role ("leader" schedules,
    a "follower" answers the API and waits to take over) and where the leader serves, if it said."""
    member = st.member
    if member is None:
        return {"status": "ok"}
    leader = member.leader()
    return {"status": "ok", "role": member.role, "leader": None if leader is None else leader.url,
            "lease_seconds_left": None if leader is None else round(leader.seconds_left, 3)}
