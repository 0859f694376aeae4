"""The `whitney` command: demo, serve, and keys (create, list and revoke API keys).

Building the parser loads neither torch nor the engine, so `whitney --help` answers at once; `serve` and
`demo` load them once their arguments are read (and `serve` has checked that its port is free).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from whitney import serving
from whitney.protocol.backend import SamplerEngine, SamplerReplicas
from whitney.protocol.config import DEFAULT_MODEL


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's help followed by its default, where it has one its help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == [] or default is argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="whitney", description="Fine-tuning through training primitives.",
                                     formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", formatter_class=_HelpFormatter,
                          help="start a server, SFT the default model over HTTP, sample before and after")
    demo.add_argument("--model", default=None,
                      help=f"base model: a repo id in the local Hugging Face cache or a directory (default: the "
                           f"embedded {DEFAULT_MODEL})")
    demo.add_argument("--steps", type=_count, default=12, help="training steps (forward_backward + optim_step)")
    demo.add_argument("--batch-size", type=_count, default=4, help="conversations per step")
    demo.add_argument("--rank", type=_count, default=16, help="LoRA rank")
    demo.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate")
    demo.add_argument("--base-url", default=None, help="use a running server at this URL instead of starting one")
    serve = sub.add_parser("serve", formatter_class=_HelpFormatter, help="start the HTTP server")
    serve.add_argument("--model", action="append", default=None,
                       help=f"base model: a repo id in the local Hugging Face cache or a directory (repeatable; "
                            f"default: the embedded {DEFAULT_MODEL})")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (0: any free port)")
    serve.add_argument("--data-dir", default=None, help="checkpoints and database (default ~/.local/share/whitney)")
    serve.add_argument("--db-url", default=None, help="SQLAlchemy URL (default: a SQLite file in the data dir)")
    serve.add_argument("--ha", action="store_true",
                       help="highly available: any number of processes started alike on one PostgreSQL --db-url "
                            "(and one --data-dir they share) answer the API; one schedules at a time, under a lease "
                            "another takes over when it dies (docs/DEPLOY.md)")
    serve.add_argument("--lease-seconds", type=float, default=None, metavar="S",
                       help="with --ha: the scheduling lease's length; a dead leader is replaced within about S "
                            "seconds (default 5)")
    serve.add_argument("--api-key", action="append", default=[], help="required bearer key (repeatable)")
    serve.add_argument("--metrics-key", default=os.environ.get("WHITNEY_METRICS_KEY"),
                       help="the operator's bearer key for GET /metrics (server-wide: every tenant's runs); with API "
                            "keys on, /metrics answers only this key, never an API key (default: "
                            "$WHITNEY_METRICS_KEY; none: /metrics answers no one while keys are on)")
    serve.add_argument("--session-timeout", type=float, default=600.0,
                       help="seconds without a heartbeat before a session expires (its open runs are then cancelled)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                       help="info: a line per HTTP request and per operation ended; warning: problems only")
    add_engine_flags(serve)
    add_backend_flags(serve)
    add_request_limit_flags(serve)
    add_key_limit_flags(serve)
    add_keys_command(sub)
    models = sub.add_parser("models", formatter_class=_HelpFormatter,
                            help="make a model load offline by the name Whitney serves it under")
    register = models.add_subparsers(dest="action", required=True).add_parser(
        "register", formatter_class=_HelpFormatter,
        help="register a model in this machine's Hugging Face cache under the name Whitney serves it by (the "
             "embedded SmolLM2 is converted first), so from_pretrained(name) loads it with HF_HUB_OFFLINE=1; "
             "`whitney serve` does this for every model it serves")
    register.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                          help="a model directory, or the embedded model's name")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve_main(args)
    if args.command == "keys":
        return keys_main(args)
    if args.command == "models":
        return register_main(args.model)
    if args.command == "demo":
        from whitney.demo import run_demo

        losses = run_demo(args.model or DEFAULT_MODEL, args.steps, args.batch_size, args.rank, args.learning_rate,
                          args.base_url)
        return 0 if losses[-1] < losses[0] else 1
    return 2


def serve_main(args) -> int:
    import logging

    problem = serving.port_problem(args.host, args.port)
    if problem is not None:  # said before minutes of model loading, in one line
        print(f"whitney serve: cannot listen on {args.host}:{args.port}: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")

    from whitney.errors import WhitneyError
    from whitney.service.app import ServiceConfig

    try:
        config = ServiceConfig(models=args.model or [DEFAULT_MODEL], api_keys=args.api_key, db_url=args.db_url,
                               session_timeout=args.session_timeout, engine=engine_config(args),
                               limits=request_limits(args), require_keys=args.require_keys,
                               key_limits=key_limits(args), metrics_key=args.metrics_key, **backend_config(args))
    except WhitneyError as e:
        print(f"whitney serve: {e.message}", file=sys.stderr)
        return 2
    if args.data_dir:
        config.data_dir = Path(args.data_dir)
    return serving.serve(config, args.host, args.port, args.log_level)


def _threads(text: str) -> int | str:
    """"auto" or an integer >= 1 (argparse reports the rule on anything else)."""
    if text == "auto":
        return text
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    """A TCP port, 0-65535 (argparse reports the rule on anything else)."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


def register_main(model: str) -> int:
    """`whitney models register`: the model's served name made to load offline here (engine/hub_cache.py)."""
    from huggingface_hub import constants

    from whitney.engine.families import hub_cache
    from whitney.engine.families.model import resolve_model_dir
    from whitney.errors import WhitneyError
    from whitney.protocol.config import shown_name

    try:
        path = resolve_model_dir(model)
    except WhitneyError as e:
        print(f"whitney models register: {e.message}", file=sys.stderr)
        return 2
    name, cache = shown_name(model), Path(constants.HF_HUB_CACHE)
    if hub_cache.register(name, path, cache):
        print(f"{name!r} now loads offline from {path} (Hugging Face cache {cache})")
        return 0
    if hub_cache.is_downloaded(cache, name):
        print(f"{name!r} is in the Hugging Face cache {cache} already (a download, left as it is)")
        return 0
    print(f"whitney models register: {name!r} could not be registered in {cache} (not a repo id, or the cache "
          "cannot be written); load it by its directory", file=sys.stderr)
    return 1


# ---- the engine ---------------------------------------------------------------------------------

def add_engine_flags(serve: argparse.ArgumentParser) -> None:
    """--device, --dtype, --threads, --max-lora-rank, --max-sequences, --max-cached-tokens, --page-idle-seconds,
    --max-resident-runs, --max-pass-mib: defaults from EngineConfig."""
    from whitney.protocol.config import EngineConfig

    default = EngineConfig()
    serve.add_argument("--max-lora-rank", type=_count, default=default.max_lora_rank,
                       help="the largest LoRA rank a run may ask for")
    serve.add_argument("--max-sequences", type=_count, default=default.max_sequences,
                       help="sampling: concurrent sequences per base model (more wait in a queue)")
    serve.add_argument("--max-cached-tokens", type=_count, default=default.max_cached_tokens,
                       help="sampling: KV-cache tokens per base model (more wait in a queue)")
    serve.add_argument("--device", default=default.device, metavar="auto|cpu|cuda|cuda:N",
                       help="where base weights, adapters, optimizer state and caches live (auto: CUDA when "
                            "present, else the CPU)")
    serve.add_argument("--threads", type=_threads, default="auto", metavar="N|auto",
                       help="compute threads of each engine process (this one, or each Ray worker, sampler "
                            "replica and sharded rank); auto: the CPUs that other programs leave free, re-read "
                            "before engine calls, at most the CPUs the process may use (a Ray worker: its CPUs), "
                            "so a busy machine does not stall training")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=default.compute_dtype,
                       help="base weights and activations (LoRA weights, optimizer and losses stay float32); "
                            "auto: float32 on the CPU, bfloat16 on CUDA; bfloat16 is several times faster on "
                            "CPUs with AVX-512 BF16")
    serve.add_argument("--page-idle-seconds", type=_seconds, default=default.page_idle_seconds, metavar="S",
                       help="page a run untouched for S seconds out to <data-dir>/paged (adapter, optimizer "
                            "state, gradients, sampler versions) and free its memory; its next operation reads it "
                            "back first, bitwise as it was (default: never)")
    serve.add_argument("--max-resident-runs", type=_count, default=default.max_resident_runs, metavar="N",
                       help="keep at most N runs' state in memory: one more coming in pages out the least "
                            "recently used first, as an idle one (default: no budget)")
    serve.add_argument("--max-pass-mib", type=_count, default=default.max_pass_mib, metavar="MIB",
                       help="training: the estimated activation memory one forward+backward pass keeps; a call's "
                            "requests beyond it run in further passes, each request whole (default: 2048 on the "
                            "CPU, a quarter of the accelerator's memory)")


def engine_config(args):
    from whitney.protocol.config import EngineConfig

    return EngineConfig(max_lora_rank=args.max_lora_rank, device=args.device, compute_dtype=args.dtype,
                        max_sequences=args.max_sequences, max_cached_tokens=args.max_cached_tokens,
                        page_idle_seconds=args.page_idle_seconds, max_resident_runs=args.max_resident_runs,
                        max_pass_mib=args.max_pass_mib, threads=args.threads)


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0 (argparse reports the rule on anything else)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    """An integer >= 1 (argparse reports the rule on anything else)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


# ---- where the engine runs ----------------------------------------------------------------------

def add_backend_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("backend", "where the engine runs (docs/DEPLOY.md)")
    from whitney.backends import BACKENDS

    group.add_argument("--backend", choices=sorted(BACKENDS), default="inprocess",
                       help="inprocess: this process (default); ray: one training worker per base model, and "
                            "--samplers replicas, as Ray actors on a cluster")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="a running Ray cluster (e.g. 10.0.0.1:6379 or auto); default: start a local one")
    group.add_argument("--samplers", default="0", metavar="K|auto|MIN..MAX",
                       help="sampler replicas per base model serving sample (default 0: the trainer samples); "
                            "auto (0..1) or MIN..MAX: elastic, a replica starts when sampling is asked for and stops "
                            "after --sampler-idle-seconds idle")
    group.add_argument("--sampler-engine", choices=[e.value for e in SamplerEngine], default="whitney",
                       help="what the replicas run: whitney (the trainer's model code: in float32 sampled "
                            "log-probs are compute_logprobs' up to rounding; --backend ray) or vllm (vLLM servers with "
                            "each run's versions as LoRA adapters, beside either backend; its own kernels, for GPUs)")
    group.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="the Python of vLLM's environment (default: .venv-vllm, made by `make vllm-env`)")
    group.add_argument("--vllm-max-loras", type=int, default=None, metavar="N",
                       help="adapters a vLLM replica holds on its device at once; more are reloaded from their "
                            f"files on demand (default {SamplerReplicas.max_loras})")
    group.add_argument("--vllm-max-model-len", type=int, default=None, metavar="N",
                       help="the longest prompt plus max_tokens a vLLM replica serves (at most the model's context; "
                            f"longer samples go to Whitney's sampler; default {SamplerReplicas.max_model_len})")
    group.add_argument("--vllm-args", default=None, metavar="'ARGS'",
                       help="more arguments for every vLLM server, e.g. '--gpu-memory-utilization 0.4' beside a "
                            "trainer on the same GPU")
    group.add_argument("--sampler-idle-seconds", type=float, default=None, metavar="S",
                       help=f"an elastic replica idle this long stops (default {SamplerReplicas.idle_seconds})")
    group.add_argument("--worker-resources", action="append", default=[], metavar="MODEL=cpus:N,gpus:N,RES:N",
                       help="ray: resources of each worker of MODEL (as given to --model or its served name); "
                            "gpus:N with N > 1 or shards:N: the trainer shards the base over N ranks (FSDP2), one "
                            "device each; other keys are custom Ray resources, e.g. a node label (repeatable; "
                            "default cpus:1)")


def backend_config(args) -> dict:
    """ServiceConfig's backend fields from the flags (InvalidInput naming the flag's rule)."""
    from whitney.errors import InvalidInput

    # SamplerReplicas' field -> (its flag, the value given or None): unset flags keep the field's default.
    settings = {"max_loras": ("--vllm-max-loras", args.vllm_max_loras),
                "max_model_len": ("--vllm-max-model-len", args.vllm_max_model_len),
                "vllm_python": ("--vllm-python", args.vllm_python),
                "vllm_args": ("--vllm-args", None if args.vllm_args is None else tuple(shlex.split(args.vllm_args))),
                "idle_seconds": ("--sampler-idle-seconds", args.sampler_idle_seconds)}
    given = {field: value for field, (_, value) in settings.items() if value is not None}
    samplers = SamplerReplicas.parse(args.samplers, engine=SamplerEngine(args.sampler_engine), **given)
    # Each setting is refused where nothing would read it, never ignored.
    if samplers.engine == SamplerEngine.VLLM and samplers.maximum == 0:
        raise InvalidInput("--sampler-engine vllm needs replicas: --samplers K, auto or MIN..MAX")
    unread = sorted(settings[f][0] for f in given if f != "idle_seconds")
    if samplers.engine != SamplerEngine.VLLM and unread:
        raise InvalidInput(f"{', '.join(unread)} set vLLM replicas: they need --sampler-engine vllm")
    if "idle_seconds" in given and not samplers.elastic:
        raise InvalidInput("--sampler-idle-seconds stops elastic replicas: it needs --samplers auto or MIN..MAX")
    whitney_replicas = samplers.maximum > 0 and samplers.engine == SamplerEngine.WHITNEY
    if args.backend != "ray" and (args.ray_address or whitney_replicas or args.worker_resources):
        raise InvalidInput("--ray-address, --worker-resources and --samplers of Whitney's own sampler need "
                           "--backend ray (vLLM replicas, --sampler-engine vllm, run beside either backend)")
    if samplers.max_loras < 1 or samplers.max_model_len < 1 or samplers.idle_seconds <= 0:
        raise InvalidInput("--vllm-max-loras and --vllm-max-model-len must be >= 1 and --sampler-idle-seconds > 0")
    resources = {}
    for spec in args.worker_resources:
        model, sep, items = spec.partition("=")
        if not sep or not model:
            raise InvalidInput(f"--worker-resources {spec!r}: write MODEL=cpus:N,gpus:N,RESOURCE:N")
        from whitney.backends.ray.placement import Placement  # torch-free

        resources[model] = Placement.parse_resources(items)
    if args.lease_seconds is not None and not args.ha:
        raise InvalidInput("--lease-seconds sets the lease of a highly available service: it needs --ha")
    if args.lease_seconds is not None and not 0.5 <= args.lease_seconds <= 3600:
        raise InvalidInput(f"--lease-seconds must be from 0.5 to 3600, got {args.lease_seconds:g}")
    if args.ha and not (args.db_url or "").startswith("postgresql"):
        raise InvalidInput("--ha needs a PostgreSQL --db-url (postgresql+psycopg://...): its processes share the "
                           "database, its lease and its notifications")
    if args.ha and samplers.engine == SamplerEngine.VLLM:
        raise InvalidInput("--ha with --sampler-engine vllm is not supported yet: each member would start vLLM "
                           "replicas of its own; use Whitney's replicas (--backend ray --samplers K), which the "
                           "members share")
    lease = (args.lease_seconds or 5.0) if args.ha else None
    return dict(backend=args.backend, ray_address=args.ray_address, samplers=samplers,
                worker_resources=resources, ha_lease_seconds=lease)


# ---- per-request limits -------------------------------------------------------------------------

def add_request_limit_flags(serve: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from whitney.service.scheduling.limits import Limits

    group = serve.add_argument_group("per-request limits", "beyond each, a request is refused with a 413 that "
                                     "states the limit (shown in /v1/training/capabilities)")
    for f in fields(Limits):
        if f.name == "image_dirs":
            group.add_argument("--image-dir", dest="image_dirs", action="append", default=[], metavar="DIR",
                               help="a directory whose images image_asset_pointer chunks may name (repeatable; "
                                    "default none: every pointer is refused)")
            continue
        group.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default, metavar="N",
                           help=f"{f.metadata['help']} (default {f.default})")


def request_limits(args):
    from dataclasses import fields

    from whitney.errors import InvalidInput
    from whitney.service.scheduling.limits import Limits

    for d in args.image_dirs:
        if not Path(d).is_dir():
            raise InvalidInput(f"--image-dir {d} is not a directory", field="image_dirs")
    return Limits(**{f.name: tuple(getattr(args, f.name)) if f.name == "image_dirs" else getattr(args, f.name)
                     for f in fields(Limits)})

# ---- API keys and per-key quotas ------------------------------------------------------------------

DEFAULT_DATA_DIR = "~/.local/share/whitney"


def _limit(name: str):
    def limit(value: str) -> int:
        from whitney.service.store.key_limits import parse_limit

        return parse_limit(name, value)
    return limit


def add_key_limit_flags(serve: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from whitney.service.store.key_limits import KeyLimits

    group = serve.add_argument_group(
        "API keys and per-key quotas", "Keys are required once --api-key is given, with --require-keys, or when "
        "the database holds a key (whitney keys create). Limits: 0 is unlimited; a file sets defaults, flags "
        "override the file, and a key's own limits override both. Beyond a limit: 429 with Retry-After.")
    group.add_argument("--require-keys", action="store_true", help="require a key even before any key exists")
    group.add_argument("--limits-file", default=None, help="TOML file of per-key limits: max_runs = 8, ...")
    for f in fields(KeyLimits):
        group.add_argument(f"--{f.name.replace('_', '-')}-per-key", dest=f.name, type=_limit(f.name), default=None,
                           metavar="BYTES" if f.name == "max_adapter_bytes" else "N",
                           help=f"{f.metadata['help']} (default {f.default}; 0: unlimited)")


def key_limits(args):
    """The server's per-key limits: the built-in defaults, then the --limits-file, then the flags."""
    from whitney.service.store.key_limits import LIMITS, KeyLimits, limits_from_file

    own = limits_from_file(args.limits_file) if args.limits_file else {}
    own.update({name: getattr(args, name) for name in LIMITS if getattr(args, name) is not None})
    return KeyLimits().override(own)


def add_keys_command(sub) -> None:
    from whitney.service.store.key_limits import LIMITS

    keys = sub.add_parser("keys", help="create, list and revoke API keys (a running server sees them within seconds)")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="make a key; it is printed once, and only its digest is stored")
    create.add_argument("--name", default=None, help="a label to recognise the key by")
    for name in LIMITS:
        create.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_limit(name), default=None,
                            metavar="BYTES" if name == "max_adapter_bytes" else "N", help="this key's own limit (0 unlimited; default: the server's)")
    listing = actions.add_parser("list", help="every key: id, name, created, revoked, limits (never the key)")
    listing.add_argument("--json", action="store_true", help="as JSON")
    revoke = actions.add_parser("revoke", help="refuse a key from now on (its runs and checkpoints stay)")
    revoke.add_argument("key_id")
    for parser in (create, listing, revoke):
        where = parser.add_mutually_exclusive_group()
        where.add_argument("--data-dir", default=None, help=f"the server's data dir (default {DEFAULT_DATA_DIR})")
        where.add_argument("--db-url", default=None, help="the server's SQLAlchemy URL")


def keys_main(args) -> int:
    import json
    import time
    from dataclasses import asdict

    from whitney.errors import NotFound
    from whitney.service.store.database import Store
    from whitney.service.store.key_limits import LIMITS
    from whitney.service.store.keys import digest_of, new_key

    if args.db_url is None:
        data_dir = Path(args.data_dir or DEFAULT_DATA_DIR).expanduser()
        data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(args.db_url or f"sqlite:///{data_dir / 'whitney.db'}")
    if args.action == "create":
        key = new_key()
        row = store.create_key(digest_of(key), args.name, {name: getattr(args, name) for name in LIMITS})
        print(key)
        label = f" ({args.name})" if args.name else ""
        print(f"created {row.id}{label}; the key above is shown only now", file=sys.stderr)
        return 0
    if args.action == "revoke":
        try:
            row = store.revoke_key(args.key_id)
        except NotFound as e:
            print(f"whitney keys revoke: {e}", file=sys.stderr)
            return 1
        label = row.name
        print(f"revoked {row.id}" + (f" ({label})" if label else ""))
        return 0
    rows = store.list_keys()
    if args.json:
        print(json.dumps([{k: v for k, v in asdict(row).items() if k != "digest"} for row in rows], indent=2))
        return 0

    def when(t: float | None) -> str:
        return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

    table = [("ID", "NAME", "CREATED", "REVOKED", "LIMITS")] + [
        (r.id, r.name or "-", when(r.created_at), when(r.revoked_at),
         ", ".join(f"{n}={getattr(r, n)}" for n in LIMITS if getattr(r, n) is not None) or "server defaults")
        for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(4)]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[4])
    return 0


if __name__ == "__main__":
    sys.exit(main())
