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


# ---------------------------------------------------------------- TensorRT engine record and checks


def _record(plan_file="engine.plan", sha="0" * 64, size=4, **kw) -> mf.EngineRecord:
    fields = dict(
        plan_file=plan_file,
        plan_sha256=sha,
        plan_bytes=size,
        source_graph="prefill",
        tensorrt_version="10.15.1",
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        profiles=[mf.EngineProfile("prefill", 0, {"input_ids": [[1, 1], [1, 96], [4, 96]]})],
        timing_cache_file="timing.cache",
        strongly_typed=True,
        workspace_bytes=None,
        device_memory_bytes=1 << 20,
        outputs=["next_token_ids"],
        cache_aliased=True,
    )
    return mf.EngineRecord(**{**fields, **kw})


def _with_engine(artifact, record: mf.EngineRecord) -> None:
    data = json.loads((artifact / "manifest.json").read_text())
    data["engines"] = {"tensorrt": record.to_dict()}
    (artifact / "manifest.json").write_text(json.dumps(data))


def test_old_manifests_read_with_cpu_target_and_no_engine(artifact_copy):
    data = json.loads((artifact_copy / "manifest.json").read_text())
    data.pop("target", None)  # an artifact written before --target existed
    (artifact_copy / "manifest.json").write_text(json.dumps(data))
    m = mf.read(artifact_copy)
    assert m.target == "cpu" and mf.engine_record(m) is None


def test_engine_record_round_trips(artifact_copy):
    plan = b"plan"
    (artifact_copy / "engine.plan").write_bytes(plan)
    import hashlib

    record = _record(sha=hashlib.sha256(plan).hexdigest(), size=len(plan))
    _with_engine(artifact_copy, record)
    m = mf.read(artifact_copy)
    assert mf.engine_record(m) == record
    assert mf.engine_record(m).profile("prefill").shapes["input_ids"][2] == [4, 96]
    with pytest.raises(mf.ArtifactError, match="no 'decode' profile; rebuild with `kvforge build OUT`"):
        mf.engine_record(m).profile("decode")


def test_changed_plan_says_rebuild(artifact_copy):
    (artifact_copy / "engine.plan").write_bytes(b"plan")
    _with_engine(artifact_copy, _record(sha="f" * 64, size=4))
    with pytest.raises(
        mf.ArtifactError, match=r"engine.plan does not match its sha256.*rebuild with `kvforge build OUT`"
    ):
        mf.read(artifact_copy)
    (artifact_copy / "engine.plan").unlink()
    with pytest.raises(mf.ArtifactError, match=r"engine.plan is missing .*; rebuild with `kvforge build OUT`"):
        mf.read(artifact_copy, verify=False)


def test_malformed_engine_record_says_rebuild(artifact_copy):
    data = json.loads((artifact_copy / "manifest.json").read_text())
    data["engines"] = {"tensorrt": {"plan_file": "engine.plan"}}
    (artifact_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(mf.ArtifactError, match=r"engines.tensorrt is malformed .*rebuild with `kvforge build OUT`"):
        mf.read(artifact_copy)


def test_engine_checks_name_what_differs():
    record = _record()
    here = dict(tensorrt_version="10.15.1", gpu_name="NVIDIA H200", compute_capability="9.0")
    mf.check_engine(record, **here)  # same TensorRT, same GPU: runs
    with pytest.raises(mf.ArtifactError) as e:
        mf.check_engine(record, **{**here, "tensorrt_version": "11.0.0"})
    assert str(e.value) == (
        "the TensorRT engine was built for TensorRT 10.15.1, this machine has TensorRT 11.0.0: "
        "rebuild with `kvforge build OUT`"
    )
    with pytest.raises(mf.ArtifactError) as e:
        mf.check_engine(record, **{**here, "gpu_name": "NVIDIA A100", "compute_capability": "8.0"})
    assert str(e.value) == (
        "the TensorRT engine was built for compute capability 9.0, this GPU (NVIDIA A100) has 8.0: "
        "rebuild with `kvforge build OUT`"
    )
    with pytest.raises(mf.ArtifactError, match=r"built for GPU 'NVIDIA H200', this GPU is 'NVIDIA H100.*rebuild"):
        mf.check_engine(record, **{**here, "gpu_name": "NVIDIA H100 80GB HBM3"})
    with pytest.raises(mf.ArtifactError, match="has no TensorRT engine; build one on this GPU: rebuild with"):
        mf.check_engine(None, **here)
