"""Package downloads, streamed: a tar archive of a package's directory written as its files are read, and one
file of it, CHUNK bytes at a time, so a download holds about one chunk of memory whatever the package's size.

The package counts as read (packages.acquire) from before the answer starts until its last byte is sent or the
client leaves, so the reaper and deletes wait for it (packages.py). The archive is byte for byte what
`tarfile.add(directory)` writes (the same headers, hard links and padding), and its length is known before the
first byte (Content-Length), so a file that changed under the download cuts the answer short instead of
sending a wrong archive.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from whitney.service.store import packages
from whitney.service.store.database import Store

CHUNK = 1 << 20  # bytes read, and sent, at a time


class _Entry:
    """One archive member: its header blocks, and the file whose bytes follow it (None: a directory, a link)."""

    __slots__ = ("header", "path", "size")

    def __init__(self, header: bytes, path: str | None, size: int):
        self.header, self.path, self.size = header, path, size


def archive(store: Store, path: str, arcname: str, filename: str) -> StreamingResponse:
    """The package directory at `path` as a tar archive whose members are under `arcname`. NotFound if the
    package has gone; the caller has checked that the caller may read it."""
    if not packages.acquire(store, path):
        raise packages.gone(path)
    try:
        entries = _entries(path, arcname)
    except BaseException:
        packages.release(store, path)
        raise
    members = sum(len(e.header) + _padded(e.size) for e in entries)
    end = 2 * tarfile.BLOCKSIZE  # tarfile's close: two zero blocks, then zeros to a whole record
    end += -(members + end) % tarfile.RECORDSIZE
    return _Streamed(_archive_chunks(entries, end), lambda: packages.release(store, path), members + end,
                     "application/x-tar", filename)


def one_file(store: Store, path: str, relative: str, filename: str) -> StreamingResponse:
    """The file `relative` of the package directory at `path` (the caller has checked it is one of its files)."""
    if not packages.acquire(store, path):
        raise packages.gone(path)
    try:
        name = os.path.join(path, relative)
        size = os.stat(name).st_size
    except BaseException:
        packages.release(store, path)
        raise
    return _Streamed(_file_chunks(name, size, relative), lambda: packages.release(store, path), size,
                     "application/octet-stream", filename)


def _entries(root: str, arcname: str) -> list[_Entry]:
    """The members `tarfile.add(root, arcname)` writes, in its order (a directory, then its entries sorted),
    with the headers it writes: one TarFile makes them all, so a file linked twice becomes a hard link as
    there. Only stats: no file is read here."""
    maker = tarfile.TarFile(fileobj=io.BytesIO(), mode="w")
    out: list[_Entry] = []

    def add(name: str, arc: str) -> None:
        info = maker.gettarinfo(name, arc)
        if info is None:  # a socket or the like: tarfile.add skips it too
            return
        regular = info.isreg()
        out.append(_Entry(info.tobuf(maker.format, maker.encoding, maker.errors), name if regular else None,
                          info.size if regular else 0))
        if info.isdir():
            for child in sorted(os.listdir(name)):
                add(os.path.join(name, child), os.path.join(arc, child))

    add(root, arcname)
    return out


def _padded(size: int) -> int:
    return size + (-size % tarfile.BLOCKSIZE)


def _archive_chunks(entries: list[_Entry], end: int) -> Iterator[bytes]:
    """The archive's bytes, in chunks of about CHUNK (headers and small files gathered into one)."""
    pending = bytearray()
    for entry in entries:
        pending += entry.header
        if entry.path is not None:
            blocks = _file_chunks(entry.path, entry.size, os.path.basename(entry.path))
            if entry.size >= CHUNK:  # a large file: what is pending, then its blocks as they are read
                yield bytes(pending)
                pending.clear()
                yield from blocks
            else:
                for block in blocks:
                    pending += block
            pending += bytes(-entry.size % tarfile.BLOCKSIZE)
        if len(pending) >= CHUNK:
            yield bytes(pending)
            pending.clear()
    pending += bytes(end)
    yield bytes(pending)


def _file_chunks(name: str, size: int, shown: str) -> Iterator[bytes]:
    """`size` bytes of the file, CHUNK at a time; OSError if it ends sooner (the answer is then cut short)."""
    with open(name, "rb") as f:
        left = size
        while left:
            block = f.read(min(CHUNK, left))
            if not block:
                raise OSError(f"{shown} became shorter while it was sent")
            left -= len(block)
            yield block


class _Streamed(StreamingResponse):
    """A streamed download that ends the package's read (`release`, on a worker thread: a store write) once it
    has been sent, failed or been left by its client."""

    def __init__(self, chunks: Iterator[bytes], release, length: int, media_type: str, filename: str):
        super().__init__(chunks, media_type=media_type, headers={
            "Content-Length": str(length), "Content-Disposition": f'attachment; filename="{filename}"'})
        self._chunks, self._release = chunks, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(self._end)

    def _end(self) -> None:
        try:
            self._chunks.close()  # a download left part-way: its open file is closed now, not when collected
        finally:
            self._release()
