"""A throwaway PostgreSQL server for the tests: Debian's `initdb` and `pg_ctl` on a free port in a temporary
directory, stopped (and its files removed) afterwards.

PostgreSQL refuses to run as root: as root, the server runs as the `postgres` system user the Debian package
creates. `make test` installs the package where it is missing (apt, as root).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def pg_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory (with initdb), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """`with PostgresServer() as pg: pg.new_database()` -> a SQLAlchemy URL of a fresh, empty database."""

    def __init__(self):
        bin_dir = pg_bin()
        if bin_dir is None:
            raise FileNotFoundError("no PostgreSQL (initdb) under /usr/lib/postgresql/*/bin")
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="whitney-pg-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None

    def _run(self, *cmd: str) -> None:
        if self.user is not None:  # as root: the postgres user runs it
            cmd = ("runuser", "-u", "postgres", "--", *cmd)
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=self.dir)

    def start(self) -> "PostgresServer":
        data = self.dir / "data"
        if self.user is not None:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        self._run(str(self.bin / "initdb"), "-D", str(data), "-A", "trust", "-U", "whitney", "--no-sync")
        self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "log"), "-w", "start", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                  "-c max_connections=200")
        return self

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def new_database(self) -> str:
        """A new empty database; its SQLAlchemy URL (the psycopg 3 driver)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=whitney dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://whitney@127.0.0.1:{self.port}/{name}"

    def __enter__(self) -> "PostgresServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
