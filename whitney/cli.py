"""The `whitney` command: demo (and, as the service lands, serve)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="whitney", description="Fine-tuning through training primitives.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="start a server, SFT the default model over HTTP, sample before and after")
    demo.add_argument("--model", default=None, help="base model name or local directory")
    demo.add_argument("--steps", type=int, default=12)
    demo.add_argument("--batch-size", type=int, default=4)
    demo.add_argument("--rank", type=int, default=16)
    demo.add_argument("--learning-rate", type=float, default=1e-3)
    demo.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    serve = sub.add_parser("serve", help="start the HTTP server")
    serve.add_argument("--model", action="append", default=None,
                       help="base model name or local directory (repeatable; default the embedded SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", default=None, help="checkpoints and database (default ~/.local/share/whitney)")
    serve.add_argument("--db-url", default=None, help="SQLAlchemy URL (default sqlite in the data dir)")
    serve.add_argument("--api-key", action="append", default=[], help="required bearer key (repeatable)")
    serve.add_argument("--session-timeout", type=float, default=600.0, help="seconds without heartbeat")
    serve.add_argument("--max-lora-rank", type=int, default=128)
    serve.add_argument("--max-sequences", type=int, default=256, help="sampling: concurrent sequences")
    serve.add_argument("--max-cached-tokens", type=int, default=262_144, help="sampling: KV-cache tokens")
    serve.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                       help="base weights and activations (LoRA weights, optimizer and losses stay float32); "
                            "bfloat16 is several times faster on CPUs with AVX-512 BF16")
    args = parser.parse_args(argv)

    if args.command == "serve":
        return serve_main(args)

    if args.command == "demo":
        from whitney.demo import run_demo
        from whitney.engine import DEFAULT_MODEL

        losses = run_demo(args.model or DEFAULT_MODEL, args.steps, args.batch_size, args.rank, args.learning_rate,
                          args.base_url)
        return 0 if losses[-1] < losses[0] else 1
    return 2


def serve_main(args) -> int:
    import signal
    import threading

    from whitney.engine import DEFAULT_MODEL
    from whitney.service.app import ServiceConfig, create_app, serve_in_thread

    config = ServiceConfig(models=args.model or [DEFAULT_MODEL], api_keys=args.api_key, db_url=args.db_url,
                           session_timeout=args.session_timeout, max_lora_rank=args.max_lora_rank,
                           max_sequences=args.max_sequences, max_cached_tokens=args.max_cached_tokens,
                           compute_dtype=args.dtype)
    if args.data_dir:
        config.data_dir = Path(args.data_dir)
    # HTTP on a thread, the engine's worker loop on the main thread (see Scheduler.run for why).
    app = create_app(config, worker_thread=False)
    scheduler = app.state.whitney.scheduler
    server = serve_in_thread(app, args.host, args.port)
    print(f"Whitney is serving {', '.join(config.models)} at {server.url}", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: scheduler.stop())
    # Should the HTTP thread ever end on its own, stop the worker too rather than serve nothing.
    threading.Thread(target=lambda: (server.thread.join(), scheduler.stop()), daemon=True).start()
    try:
        scheduler.run()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
