"""hub_cache.register: a served model's directory laid out in a Hugging Face hub cache under its served name,
so `from_pretrained(<name>)` finds it offline; real downloads are never touched."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from whitney.engine.families import hub_cache


def test_a_registered_name_loads_offline_from_the_directorys_own_files(tiny_llama, tmp_path):
    cache = tmp_path / "hub"
    assert hub_cache.register("acme/tiny-llama", Path(tiny_llama), cache)
    tokenizer = AutoTokenizer.from_pretrained("acme/tiny-llama", cache_dir=cache, local_files_only=True)
    assert tokenizer.encode("Hello there") == AutoTokenizer.from_pretrained(tiny_llama).encode("Hello there")
    assert AutoConfig.from_pretrained("acme/tiny-llama", cache_dir=cache).hidden_size == 64
    snapshot = hub_cache.repo_folder(cache, "acme/tiny-llama") / "snapshots" / hub_cache.revision_of(
        Path(tiny_llama))
    links = sorted(p.name for p in snapshot.iterdir())
    assert links == sorted(os.listdir(tiny_llama)), "every file of the directory, linked"
    assert all(p.is_symlink() for p in snapshot.iterdir()), "links, not copies: nothing is duplicated on disk"
    assert hub_cache.registered_directory(cache, "acme/tiny-llama") == Path(tiny_llama)


def test_a_name_registered_for_another_directory_is_pointed_at_the_new_one(tiny_llama, tiny_qwen3, tmp_path):
    cache = tmp_path / "hub"
    assert hub_cache.register("model", Path(tiny_llama), cache)
    assert hub_cache.register("model", Path(tiny_qwen3), cache)
    assert hub_cache.registered_directory(cache, "model") == Path(tiny_qwen3)
    assert AutoConfig.from_pretrained("model", cache_dir=cache, local_files_only=True).model_type == "qwen3"
    assert hub_cache.register("model", Path(tiny_qwen3), cache), "registering again is a no-op that succeeds"


def test_a_real_download_under_that_name_is_never_touched(tiny_llama, tiny_qwen3, tmp_path):
    cache = tmp_path / "hub"
    folder = hub_cache.repo_folder(cache, "org/model")
    shutil.copytree(tiny_qwen3, folder / "snapshots" / ("0" * 40))  # as a download (plain files)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    assert not hub_cache.register("org/model", Path(tiny_llama), cache)
    assert (folder / "refs" / "main").read_text() == "0" * 40
    assert sorted(p.name for p in (folder / "snapshots").iterdir()) == ["0" * 40]
    assert AutoConfig.from_pretrained("org/model", cache_dir=cache, local_files_only=True).model_type == "qwen3"


def test_names_that_are_no_repo_id_and_unwritable_caches_cost_only_the_name(tiny_llama, tmp_path, caplog):
    cache = tmp_path / "hub"
    assert not hub_cache.register("my model", Path(tiny_llama), cache)
    assert not cache.exists(), "nothing written for a name no client could ask for"
    cache.write_text("a file where the cache's directory should be")  # unwritable, even for root
    with caplog.at_level(logging.WARNING, logger="whitney.engine.families.hub_cache"):
        assert not hub_cache.register("acme/tiny", Path(tiny_llama), cache)
    assert "could not register 'acme/tiny'" in caplog.text
