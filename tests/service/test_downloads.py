"""Checkpoint downloads are streamed (issue 31, item 11): an archive, or one file by a signed URL, far bigger than
the memory a download may hold goes out with about one chunk held at a time, byte for byte what `tarfile.add`
writes; the package counts as read until the download ends, whether it finished or its client left."""

from __future__ import annotations

import hashlib
import os
import tarfile
import tracemalloc
from pathlib import Path

from tests.service.test_checkpoint_lifecycle import new_package
from tests.service.test_flow import expect, until

BIG = 32 << 20  # the package's big file
BOUND = 8 << 20  # the most a download may hold at once (old code: the whole archive, twice)


def big_package(server, tmp_path: Path):
    """A package of the server's store (owner '': no keys) holding a 32 MiB file, a small one, a sub-directory
    and a hard link (which tarfile writes as a link member)."""
    package = new_package(server.app.state.whitney.store, tmp_path, owner="")
    root = Path(package.path)
    block = os.urandom(1 << 20)
    with open(root / "weights.bin", "wb") as f:
        for i in range(BIG >> 20):
            f.write(block[i:] + block[:i])
    (root / "nested").mkdir()
    (root / "nested" / "config.json").write_text('{"rank": 4}')
    os.link(root / "nested" / "config.json", root / "nested" / "linked.json")
    return package


def fetched(http, url: str, out: Path) -> int:
    """Stream `url` into the file `out`; the most memory this process held meanwhile (server and client)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with http.stream("GET", url) as r, open(out, "wb") as f:
            assert r.status_code == 200, r.read()
            assert int(r.headers["content-length"]) >= BIG
            for chunk in r.iter_raw():
                f.write(chunk)
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def test_an_archive_far_bigger_than_the_bound_streams_byte_identical(server, tmp_path):
    package = big_package(server, tmp_path)
    http = server.http()
    got = tmp_path / "got.tar"
    peak = fetched(http, f"/v1/checkpoints/{package.id}/archive", got)
    assert peak < BOUND, f"the download held {peak / 2**20:.1f} MiB at once for a {BIG >> 20} MiB file"
    want = tmp_path / "want.tar"
    with tarfile.open(want, "w") as tar:  # what the archive was before it was streamed
        tar.add(package.path, arcname=f"{package.name}-v{package.version}")
    assert got.stat().st_size == want.stat().st_size and digest(got) == digest(want)
    with tarfile.open(got) as tar:
        members = {m.name: m for m in tar.getmembers()}
        top = f"{package.name}-v{package.version}"
        assert members[f"{top}/nested/linked.json"].islnk()
        assert tar.extractfile(f"{top}/nested/config.json").read() == b'{"rank": 4}'
        with tar.extractfile(f"{top}/weights.bin") as f, open(Path(package.path) / "weights.bin", "rb") as g:
            while block := f.read(1 << 20):
                assert block == g.read(len(block))
    assert server.app.state.whitney.store.get_package(package.id).readers == 0, "the download's read never ended"
    assert expect(http.delete(f"/v1/checkpoints/{package.id}"), 200)["id"] == package.id


def test_a_signed_file_streams_and_a_left_download_ends_its_read(server, tmp_path, monkeypatch):
    package = big_package(server, tmp_path)
    http = server.http()
    urls = expect(http.get(f"/v1/checkpoints/{package.id}/files"), 200)["urls"]
    assert set(urls) == {"adapter.safetensors", "weights.bin", "nested/config.json", "nested/linked.json"}
    got = tmp_path / "weights.bin"
    peak = fetched(http, urls["weights.bin"], got)
    assert peak < BOUND, f"the download held {peak / 2**20:.1f} MiB at once for a {BIG >> 20} MiB file"
    assert digest(got) == digest(Path(package.path) / "weights.bin")

    # A client that leaves after the first chunk: the package stops counting it as a reader, so it can be deleted.
    store = server.app.state.whitney.store
    with http.stream("GET", f"/v1/checkpoints/{package.id}/archive") as r:
        chunks = r.iter_raw(1 << 20)  # held: a dropped iterator closes the connection
        next(chunks)
        assert store.get_package(package.id).readers == 1
        expect(http.delete(f"/v1/checkpoints/{package.id}"), 409)  # being read
    until(lambda: store.get_package(package.id).readers == 0, 30, "the left download's read to end")
    assert expect(http.delete(f"/v1/checkpoints/{package.id}"), 200)["id"] == package.id
