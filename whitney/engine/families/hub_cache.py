"""The names Whitney hands out resolve offline on the serving machine.

Clients load a served model's tokenizer and base by the name the server gives them: the Tinker SDK's
`get_tokenizer()` calls `AutoTokenizer.from_pretrained(<served name>)`, and an exported PEFT adapter's
`base_model_name_or_path` is the served name. The embedded SmolLM2 is served as its hub id and a directory
under its own name, neither of which is in the Hugging Face cache, so offline both failed.

`register` lays a served model's directory out in the local Hugging Face hub cache under its served name, the
way a download would (`models--{org}--{name}/refs/main` naming a snapshot), the snapshot's files being
symbolic links to the directory's own files (nothing is copied). `from_pretrained(<served name>)` then finds
it offline in any process that uses the same cache (HF_HUB_CACHE, HF_HOME, or ~/.cache/huggingface/hub).

Rules: a name that is not a valid repo id (spaces, over 96 characters) is left alone (clients load the model
by its directory); a real download already in the cache under that name is never touched; a name
registered earlier for another directory is re-pointed at this one. A cache that cannot be written (read-only,
permissions) only costs the offline names: the model is served all the same.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def repo_folder(cache: Path, name: str) -> Path:
    """The hub cache's folder of repo `name` ("org/model" -> models--org--model)."""
    return cache / ("models--" + name.replace("/", "--"))


def revision_of(directory: Path) -> str:
    """The snapshot name a directory is registered under: 40 hex digits, like a commit, fixed per directory."""
    return hashlib.sha1(f"whitney-served:{directory.resolve()}".encode()).hexdigest()


def registered_directory(cache: Path, name: str) -> Path | None:
    """The directory `name` was registered for by `register`; None if it is not registered or is a real
    download (whose files are blobs inside the repo folder, or plain files)."""
    folder = repo_folder(cache, name)
    try:
        revision = (folder / "refs" / "main").read_text().strip()
    except OSError:
        return None
    config = folder / "snapshots" / revision / "config.json"
    if not config.is_symlink():
        return None
    target = Path(os.readlink(config))
    if not target.is_absolute() or folder.resolve() in target.parents:
        return None
    return target.parent


def is_downloaded(cache: Path, name: str) -> bool:
    """Whether the cache already holds `name` as something other than a registration of ours."""
    folder = repo_folder(cache, name)
    return (folder / "refs" / "main").exists() and registered_directory(cache, name) is None


def register(name: str, directory: Path, cache: Path | None = None) -> bool:
    """Make `from_pretrained(name)` find `directory` offline through the hub cache (default: the one
    huggingface_hub uses in this process). Returns whether `name` now resolves to `directory`."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    cache = Path(cache or constants.HF_HUB_CACHE)
    directory = directory.resolve()
    try:
        validate_repo_id(name)
    except HFValidationError:
        log.info("%r is not a Hugging Face repo id: clients load this model by its directory", name)
        return False
    if registered_directory(cache, name) == directory:
        return True
    if is_downloaded(cache, name):
        log.info("%r is already in the Hugging Face cache (%s): clients loading it by name get that copy", name,
                 cache)
        return False
    try:
        _write(cache, name, directory)
    except OSError as e:
        log.warning("could not register %r in the Hugging Face cache %s (%s): clients load it by its directory",
                    name, cache, e)
        return False
    return True


def _write(cache: Path, name: str, directory: Path) -> None:
    """The snapshot (links to the directory's files), then refs/main; each written aside and renamed in, so a
    reader, or another process registering the same name, never sees half of it."""
    folder = repo_folder(cache, name)
    revision = revision_of(directory)
    snapshot = folder / "snapshots" / revision
    if not snapshot.exists():
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".whitney-", dir=snapshot.parent))
        for path in directory.rglob("*"):
            if path.is_file():
                link = staging / path.relative_to(directory)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path)
        try:
            os.rename(staging, snapshot)
        except OSError:  # another process registered it first
            shutil.rmtree(staging, ignore_errors=True)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    ref = folder / "refs" / f".main-{os.getpid()}"
    ref.write_text(revision)
    os.replace(ref, folder / "refs" / "main")
    log.info("registered %r in the Hugging Face cache %s: it loads offline by that name", name, cache)
