"""Hub ids as compile sources, offline: resolved from a Hugging Face cache folder the test builds.

Proves: with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` at a folder holding
``models--org--name/snapshots/<commit>/`` and ``refs/main`` (huggingface_hub's layout), ``kvforge
compile org/name`` compiles the cached model (its greedy tokens equal the same model compiled from
its directory) and the manifest records the repo and commit; ``--revision`` picks a commit; an id
that is not cached fails with one line that says so and what to do; a local path of the same
spelling wins over the Hub id; ``--revision`` on a local path is refused.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kvforge.compile import source as source_stage
from kvforge.runtime import Engine
from kvforge.tools.cli import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(llama_dir, tmp_path, monkeypatch):
    """A Hub cache holding ``kvforge-test/tiny-llama`` (the tiny Llama of ``llama_dir``) at ``COMMIT``."""
    cache = tmp_path / "hub"
    repo = cache / "models--kvforge-test--tiny-llama"
    shutil.copytree(llama_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder named like the id
    return cache


def test_compile_a_cached_hub_id_offline(hub_cache, llama_artifact, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compile", "kvforge-test/tiny-llama", "-o", str(out), "--max-seq", "96", "-q"]
    assert main([*argv, "--no-score-graph", "--no-optimize"]) == 0
    record = json.loads((out / "manifest.json").read_text())["source"]
    assert record["hub"] == {"repo_id": "kvforge-test/tiny-llama", "revision": "main", "commit": COMMIT}
    assert record["path"].endswith(f"snapshots/{COMMIT}")
    with Engine.load(out) as engine, Engine.load(llama_artifact) as reference:
        [got] = engine.generate([[0, 5, 9, 14]], max_new_tokens=8)
        [want] = reference.generate([[0, 5, 9, 14]], max_new_tokens=8)
    assert got.token_ids == want.token_ids


def test_revision_selects_a_cached_commit(hub_cache):
    source = source_stage.from_hub("kvforge-test/tiny-llama", COMMIT)
    assert source.model_dir.name == COMMIT and source.record["hub"]["revision"] == COMMIT


def test_an_id_not_in_the_cache_is_one_line_saying_what_to_do(hub_cache, tmp_path, capsys):
    assert main(["compile", "kvforge-test/absent", "-o", str(tmp_path / "x"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "kvforge-test/absent is not in the Hugging Face cache" in err
    assert str(hub_cache) in err and "HF_HUB_OFFLINE is set" in err and "unset HF_HUB_OFFLINE" in err
    assert not (tmp_path / "x").exists()


def test_a_local_path_wins_over_the_hub_id(hub_cache, llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "kvforge-test" / "absent")  # not cached: only the path can resolve
    with source_stage.resolve("kvforge-test/absent", None, tmp_path / "scratch") as source:
        assert source.model_dir.resolve() == (tmp_path / "kvforge-test" / "absent").resolve()
        assert source.record == {}


def test_revision_on_a_local_path_is_refused(llama_dir, tmp_path, capsys):
    assert main(["compile", str(llama_dir), "-o", str(tmp_path / "x"), "--revision", "v1"]) == 2
    assert "--revision v1 applies to Hugging Face Hub ids" in capsys.readouterr().err
