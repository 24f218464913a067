"""manifest.json: round trip, and the runtime's refusal of foreign, stale or corrupted artifacts."""

from __future__ import annotations

import json
import shutil

import pytest

from kvforge.graphs import manifest as mf


@pytest.fixture
def artifact_copy(llama_artifact, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(llama_artifact, out)
    return out


def test_round_trip(llama_artifact):
    m = mf.read(llama_artifact)
    assert mf.Manifest.from_dict({k: v for k, v in json.loads(m.to_json()).items() if k != "format"}) == m


def test_missing_manifest_is_not_an_artifact(tmp_path):
    with pytest.raises(mf.ArtifactError, match="not a kvforge artifact"):
        mf.read(tmp_path)


def test_other_schema_version_says_recompile(artifact_copy):
    data = json.loads((artifact_copy / "manifest.json").read_text())
    data["schema_version"] = 999
    (artifact_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(mf.ArtifactError, match="schema_version is 999.*recompile"):
        mf.read(artifact_copy)


def test_foreign_json_is_refused(artifact_copy):
    (artifact_copy / "manifest.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(mf.ArtifactError, match="not a kvforge manifest"):
        mf.read(artifact_copy)


def test_truncated_weights_are_refused(artifact_copy):
    weights = artifact_copy / "weights.data"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(mf.ArtifactError, match=r"weights.data has 1000 bytes.*truncated"):
        mf.read(artifact_copy, verify=False)


def test_modified_graph_fails_its_hash(artifact_copy):
    graph = artifact_copy / "decode.onnx"
    graph.write_bytes(graph.read_bytes() + b"\0")
    with pytest.raises(mf.ArtifactError, match="decode.onnx does not match its sha256"):
        mf.read(artifact_copy)
