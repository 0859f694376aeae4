"""The run page's configuration panel: what the run was created with and what its operations asked for.

The run's row holds its base model and LoRA config (rank, alpha, seed, targets). Each training operation keeps
the part of its request that configures training (`operations.config`, written at submission: a forward's
`loss_fn` and `loss_config`, an optim_step's `adam_params`). A run may have 100,000 operations, so only the
newest WINDOW of each kind are read (the (run_id, seq_id) index, walked backwards) and the run's first: each
setting shows its latest value and, where it changed, its distinct values in that window (numbers as a range).
Operations made before the server kept their config have none and are not counted.
"""

from __future__ import annotations

from sqlalchemy import select

from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind
from whitney.service.store.records import RunRecord
from whitney.service.store.tables import OperationRow

WINDOW = 1000  # the newest operations of each kind whose config is read
SHOWN = 6  # distinct values listed for a setting that is not a number
SECTIONS = ((OperationKind.FORWARD_BACKWARD, "Training loss", "forward_backward"),
            (OperationKind.FORWARD, "Evaluation loss", "forward"),
            (OperationKind.OPTIM_STEP, "Optimizer (AdamW)", "optim_step"))


def targets(lora: dict) -> str:
    """The modules a LoRA config adapts, as the run page names them."""
    if lora.get("target_modules"):
        return ", ".join(lora["target_modules"])
    parts = [name for key, name in (("train_attn", "attention"), ("train_mlp", "MLP"), ("train_unembed", "unembedding"))
             if lora.get(key, True)]
    return ", ".join(parts) or "none"


def configs_query(run_id: str, kind: OperationKind, newest: bool):
    """The configs of the run's operations of `kind` in seq_id order (newest first or oldest first): a walk of the
    (run_id, seq_id) index from one end, so a LIMIT reads about that many rows however long the run."""
    return (select(OperationRow.config).where(OperationRow.run_id == run_id, OperationRow.kind == kind)
            .order_by(OperationRow.seq_id.desc() if newest else OperationRow.seq_id))


def recent_configs(store: Store, run_id: str, kind: OperationKind, window: int | None = None
                   ) -> tuple[list[dict], bool]:
    """The configs of the run's newest `window` (default WINDOW) operations of `kind`, newest first, then its
    first one's when it is older; and whether operations were left out between them."""
    window = window or WINDOW
    with store.tx() as db:
        newest = list(db.scalars(configs_query(run_id, kind, newest=True).limit(window + 1)))
        first = db.scalar(configs_query(run_id, kind, newest=False).limit(1)) if len(newest) > window else None
    cut = len(newest) > window
    configs = newest[:window] + ([first] if cut else [])
    return [c for c in configs if c], cut


def flatten(config: dict) -> dict[str, object]:
    """One operation's config as settings: `loss_fn`, `loss_config.<key>`, and each AdamW parameter by name."""
    out: dict[str, object] = {}
    if "loss_fn" in config:
        out["loss_fn"] = config["loss_fn"]
        for key, value in sorted((config.get("loss_config") or {}).items()):
            out[f"loss_config.{key}"] = value
        if "loss_config_bytes" in config:
            out["loss_config"] = f"({config['loss_config_bytes']:,} bytes)"
    out.update(config.get("adam_params") or {})
    return out


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summarize(configs: list[dict]) -> list[dict]:
    """Per setting of `configs` (newest first): `{name, latest, distinct, values, low, high}`: its newest value,
    how many distinct values it took, and those values (newest first, at most SHOWN) or, for a number that
    changed, its lowest and highest. A setting missing from some configs counts them as None."""
    rows = [flatten(c) for c in configs]
    names = list(dict.fromkeys(name for row in rows for name in row))
    out = []
    for name in names:
        values = [row.get(name) for row in rows]
        distinct: dict[str, object] = {}  # by repr: a dict or list value is unhashable
        for value in values:
            distinct.setdefault(repr(value), value)
        numeric = len(distinct) > 1 and all(_number(v) for v in values)
        out.append({"name": name, "latest": values[0], "distinct": len(distinct),
                    "values": [] if numeric else list(distinct.values())[:SHOWN],
                    "low": min(values) if numeric else None, "high": max(values) if numeric else None})
    return out


def run_config(store: Store, run: RunRecord) -> dict:
    """The panel's content: the run's LoRA settings, and per operation kind the summarized settings of its
    newest operations (`sections`: `{title, kind, seen, cut, settings}`)."""
    lora = run.lora or {}
    sections = []
    for kind, title, name in SECTIONS:
        configs, cut = recent_configs(store, run.id, kind)
        if configs:
            sections.append({"title": title, "kind": name, "seen": len(configs), "cut": cut,
                             "settings": summarize(configs)})
    return {"base_model": run.base_model, "rank": lora.get("rank"), "alpha": lora.get("alpha"),
            "seed": lora.get("seed"), "targets": targets(lora), "resume_from": run.resume_from,
            "sections": sections, "window": WINDOW}
