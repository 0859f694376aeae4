"""`whitney serve` once its settings are read: the server started (HTTP on a thread, the engine's worker loop
on the main thread), its startup lines, and its stop on SIGTERM or SIGINT; and whether its port is free.
Loads the service (and, through the backend, torch) only when it starts."""

from __future__ import annotations

import os

# After SIGTERM or SIGINT, `whitney serve` waits at most this long for the engine call and the requests in
# progress, then exits anyway (what they did is recovered at the next start, as after a crash).
STOP_SECONDS = 10.0


def serve(config, host: str, port: int, log_level: str) -> int:
    """Serve `config` (a ServiceConfig) on host:port until a signal stops it; the process's exit status."""
    import signal
    import sys
    import threading

    from whitney.errors import WhitneyError
    from whitney.heap import share_arenas
    from whitney.service.app import create_app, serve_in_thread

    share_arenas()  # before the request threads start: they share the heap's freed memory, not each keep its own
    # HTTP on a thread, the engine's worker loop on the main thread (see Scheduler.run for why).
    try:
        app = create_app(config, worker_thread=False)
    except WhitneyError as e:  # e.g. --device cuda without CUDA, a model that is not there
        print(f"whitney serve: {e.message}", file=sys.stderr)
        return 2
    member = app.state.whitney.member  # a highly available service's member (service/cluster), or None
    scheduler = app.state.whitney.scheduler if member is None else member.scheduler  # this process's own
    try:
        server = serve_in_thread(app, host, port, log_level=log_level)
    except RuntimeError as e:  # the port was taken while the models loaded
        print(f"whitney serve: {e}", file=sys.stderr)
        return 2
    up_to = "up to " if scheduler.backend.config.threads == "auto" else ""  # fewer while the CPU is busy
    placed = sorted({f"{m.device}, {m.compute_dtype}, {up_to}{m.compute_threads} compute thread"
                     + ("s" if m.compute_threads != 1 else "") for m in scheduler.backend.models.values()})
    print(f"Whitney is serving {', '.join(config.models)} at {server.url} ({'; '.join(placed)})", flush=True)
    print(f"The web console is at {server.url}/console/"
          + (" (sign in with an API key)" if app.state.whitney.keys.required() else ""), flush=True)

    def stop(signum: int) -> None:
        if stopping.is_set():  # a second signal: stop now
            print(f"Whitney stopped at once ({signal.Signals(signum).name} again).", flush=True)
            os._exit(0)
        stopping.set()
        after = ("the next leader takes over what is still queued (docs/DEPLOY.md)" if member is not None else
                 "operations still queued then fail with server_restarted, their runs interrupted (resume from a "
                 "checkpoint)")
        print(f"Whitney is stopping ({signal.Signals(signum).name}) once the engine call in progress ends (at most "
              f"{STOP_SECONDS:g} s); {after}", flush=True)
        deadline = threading.Timer(STOP_SECONDS, stop_now)
        deadline.daemon = True  # a stop that ends in time does not wait for it
        deadline.start()
        server.server.should_exit = True  # no new requests; those in flight get a few seconds (serve_in_thread)
        threading.Thread(target=scheduler.stop, daemon=True).start()  # it joins the worker threads

    def stop_now() -> None:
        print(f"Whitney stopped without waiting longer for work still running {STOP_SECONDS:g} s after the signal "
              "(its operations fail with server_restarted at the next start).", flush=True)
        os._exit(0)

    stopping = threading.Event()
    on_signals((signal.SIGINT, signal.SIGTERM), stop)
    # Should the HTTP thread ever end on its own, stop the worker too rather than serve nothing.
    threading.Thread(target=lambda: (server.thread.join(), scheduler.stop(), stopping.set()), daemon=True).start()
    try:
        if member is not None:  # a highly available member: it schedules once it leads (service/cluster)
            member.url = server.url
            print(f"Whitney is a member of a highly available service (lease {config.ha_lease_seconds:g} s): "
                  "it schedules once it holds the lease", flush=True)
            while not (member.elected.wait(0.5) or stopping.is_set()):
                pass
            if not stopping.is_set():
                print("Whitney leads scheduling now", flush=True)
                member.lead(start_scheduler=False)
                scheduler.run()
        else:
            scheduler.run()
    finally:
        server.stop()
    print("Whitney stopped.", flush=True)
    return 0



def on_signals(signals, act) -> None:
    """Call act(signum) on a thread of its own as soon as one of `signals` arrives, whatever the main thread is
    doing (a Python signal handler runs on the main thread only, between two of its bytecodes: not while it is
    inside a long engine call). The signal module writes each signal's number to a pipe this thread reads."""
    import signal
    import threading

    read, write = os.pipe()
    os.set_blocking(write, False)
    for sig in signals:
        signal.signal(sig, lambda *_: None)  # handled: the thread below acts
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            for signum in os.read(read, 64):
                if signum in signals:
                    act(signum)

    threading.Thread(target=watch, name="whitney-signals", daemon=True).start()


def port_problem(host: str, port: int) -> str | None:
    """Why `whitney serve` could not listen on host:port (taken, or not an address of this machine), as one
    line; None when it can. Port 0 (any free port) always can."""
    import errno
    import socket

    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"{host!r} is not an address of this machine ({e.strerror})"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed server's port is free
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "the port is in use (another server?); stop it or choose another --port"
            return (e.strerror or str(e)).lower()
    return None
