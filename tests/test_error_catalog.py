"""docs/errors.md is true: every row's refusal is triggered and prints the documented message.

Reads the catalog's tables (id, message); for each row id runs the trigger below and asserts every
fixed piece of the documented message (the text between ``…``) appears, in order, in what the code
raises (or the server answers, with the row's HTTP status, or the CLI prints). Rows without a
trigger and triggers without a row both fail, so the page and the code cannot drift apart.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import threading
from pathlib import Path

import pytest

from kvforge.compile import compile_model
from kvforge.graphs import environment
from kvforge.graphs import manifest as mf
from kvforge.runtime import Engine, KVBlock, KVBlockError, SamplingParams, backends
from tests.helpers import corrupt_head_size

CATALOG = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ROW = re.compile(r"^\| `([a-z0-9-]+)` \| `(.+?)` \|")


def catalog() -> dict[str, str]:
    rows = {}
    for line in CATALOG.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"row id {m.group(1)} appears twice"
            rows[m.group(1)] = m.group(2)
    return rows


ROWS = catalog()
TRIGGERS = {}


def trigger(row_id: str):
    def register(fn):
        TRIGGERS[row_id] = fn
        return fn

    return register


def raised(fn, kind: type[BaseException] = ValueError) -> str:
    """The message of the ``kind`` error ``fn()`` raises (a stream is iterated once)."""
    with pytest.raises(kind) as info:
        result = fn()
        if hasattr(result, "__next__"):
            next(result)
    return str(info.value)


# ------------------------------------------------------------------------------------------ fixtures


class Ctx:
    """What triggers need: the session artifacts, a loaded engine, a scratch copy to corrupt."""

    def __init__(self, llama_artifact, llama_chat_artifact, llama_dir, tmp: Path, engine: Engine) -> None:
        self.artifact, self.chat_artifact, self.model_dir, self.tmp, self.engine = (
            llama_artifact,
            llama_chat_artifact,
            llama_dir,
            tmp,
            engine,
        )
        self.scratch = tmp / "scratch"
        shutil.copytree(llama_artifact, self.scratch)

    @contextlib.contextmanager
    def edited(self, name: str, edit):
        """The scratch artifact with ``name``'s bytes replaced by ``edit(bytes)``, restored after."""
        path = self.scratch / name
        original = path.read_bytes()
        path.write_bytes(edit(original))
        try:
            yield self.scratch
        finally:
            path.write_bytes(original)

    def manifest_edit(self, change):
        def edit(raw: bytes) -> bytes:
            data = json.loads(raw)
            change(data)
            return json.dumps(data).encode()

        return self.edited("manifest.json", edit)


@pytest.fixture(scope="module")
def ctx(llama_artifact, llama_chat_artifact, llama_dir, tmp_path_factory):
    with Engine.load(llama_artifact, threads=1) as engine:
        yield Ctx(llama_artifact, llama_chat_artifact, llama_dir, tmp_path_factory.mktemp("catalog"), engine)


# ------------------------------------------------------------------------------------------ artifact


@trigger("artifact-missing")
def _(c):
    return raised(lambda: Engine.load(c.tmp / "nope"), mf.ArtifactError)


@trigger("artifact-not-kvforge")
def _(c):
    (c.tmp / "empty").mkdir(exist_ok=True)
    return raised(lambda: Engine.load(c.tmp / "empty"), mf.ArtifactError)


@trigger("manifest-invalid-json")
def _(c):
    with c.edited("manifest.json", lambda b: b[:-20]) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("manifest-foreign")
def _(c):
    with c.edited("manifest.json", lambda b: b'{"format": "other"}') as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("manifest-schema")
def _(c):
    with c.manifest_edit(lambda d: d.update(schema_version=99)) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("speculative-no-verify-graph")
def _(c):
    def schema_1(d):
        d.update(schema_version=1)
        del d["graphs"]["verify"]

    with c.manifest_edit(schema_1) as art:
        return raised(lambda: Engine.load(art, speculative="ngram"), mf.ArtifactError)


@trigger("draft-tokenizer")
def _(c):
    with c.edited("tokenizer.json", lambda b: b.replace(b'"<|endoftext|>"', b'"<|end|>"', 1)) as draft:
        return raised(lambda: Engine.load(c.artifact, draft=draft, verify=False), mf.ArtifactError)


@trigger("speculative-value")
def _(c):
    return raised(lambda: Engine.load(c.artifact, speculative="beam"))


@trigger("manifest-field")
def _(c):
    with c.manifest_edit(lambda d: d["limits"].update(max_seq="96")) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("manifest-parser")
def _(c):
    with c.manifest_edit(lambda d: d.update(tool_parser="xml")) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("manifest-inconsistent")
def _(c):
    with c.manifest_edit(lambda d: d["limits"].update(max_seq=4096)) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("manifest-outside")
def _(c):
    with c.manifest_edit(lambda d: d["weights"].update(file="../weights.data")) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("graph-dims")
def _(c):
    with c.manifest_edit(lambda d: d["model"].update(vocab_size=383)) as art:
        return raised(lambda: Engine.load(art, verify=False), mf.ArtifactError)


@trigger("file-missing")
def _(c):
    shutil.move(c.scratch / "weights.data", c.tmp / "weights.data")
    try:
        return raised(lambda: Engine.load(c.scratch), mf.ArtifactError)
    finally:
        shutil.move(c.tmp / "weights.data", c.scratch / "weights.data")


@trigger("file-truncated")
def _(c):
    with c.edited("weights.data", lambda b: b[:1000]) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("file-sha256")
def _(c):
    with c.edited("weights.data", lambda b: bytes([b[0] ^ 1]) + b[1:]) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("graph-unloadable")
def _(c):
    with c.edited("prefill.ort.onnx", lambda b: bytes([b[0] ^ 1]) + b[1:]) as art:
        return raised(lambda: Engine.load(art, verify=False), mf.ArtifactError)


@trigger("graph-run-failed")
def _(c):
    from kvforge.runtime.ort_backend import GraphRunError

    with c.edited("prefill.ort.onnx", lambda b: b) as art:
        corrupt_head_size(art / "prefill.ort.onnx")
        with Engine.load(art, threads=1, verify=False) as engine:
            return raised(lambda: engine.generate([[1, 2]], max_new_tokens=1), GraphRunError)


@trigger("tokenizer-unreadable")
def _(c):
    with c.edited("tokenizer.json", lambda b: b"{x" + b[2:]) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("bfloat16-on-cpu")
def _(c):
    def to_bf16(d):
        d["dtype"] = "bfloat16"
        d["kv_cache"]["dtype"] = "bfloat16"

    with c.manifest_edit(to_bf16) as art:
        return raised(lambda: Engine.load(art), mf.ArtifactError)


@trigger("generation-config")
def _(c):
    with c.edited("generation_config.json", lambda b: b"{not json") as art:
        return raised(lambda: Engine.load(art))


# ------------------------------------------------------------------------------------------ compile


@trigger("model-dir-missing")
def _(c):
    return raised(lambda: compile_model(c.tmp / "no-model", c.tmp / "out", progress=None))


@trigger("hub-not-cached")
def _(c):
    import os
    from unittest import mock

    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(c.tmp / "empty-hub-cache")}
    with mock.patch.dict(os.environ, env):  # the repository root has no folder kvforge-test/
        return raised(lambda: compile_model("kvforge-test/absent", c.tmp / "out", progress=None))


@trigger("revision-local")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", revision="v1", progress=None))


@trigger("gguf-not-gguf")
def _(c):
    (c.tmp / "fake.gguf").write_bytes(b"not a gguf file")
    return raised(lambda: compile_model(c.tmp / "fake.gguf", c.tmp / "out", progress=None))


@trigger("model-dir-not-hf")
def _(c):
    (c.tmp / "not-hf").mkdir(exist_ok=True)
    (c.tmp / "not-hf" / "weights.bin").write_bytes(b"x")
    return raised(lambda: compile_model(c.tmp / "not-hf", c.tmp / "out", progress=None))


@trigger("remote-code")
def _(c):
    model = c.tmp / "remote"
    model.mkdir(exist_ok=True)
    config = {
        "architectures": ["XForCausalLM"],
        "model_type": "x",
        "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"},
    }
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    return raised(lambda: compile_model(model, c.tmp / "out", progress=None))


@trigger("weights-mismatch")
def _(c):
    from safetensors.torch import load_file, save_file

    model = c.tmp / "mismatch"
    shutil.copytree(c.model_dir, model, dirs_exist_ok=True)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:16]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return raised(lambda: compile_model(model, c.tmp / "out", progress=None))


@trigger("unsupported-architecture")
def _(c):
    model = c.tmp / "bert"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    (model / "model.safetensors").write_bytes(b"")
    return raised(lambda: compile_model(model, c.tmp / "out", progress=None))


@trigger("output-dir-foreign")
def _(c):
    out = c.tmp / "mine"
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text("keep me")
    return raised(lambda: compile_model(c.model_dir, out, progress=None))


@trigger("max-seq-positions")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", max_seq=10**6, progress=None))


@trigger("compile-count-type")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", max_batch=2.5, progress=None), TypeError)


@trigger("lm-head-needs-quantize")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", lm_head="int8", progress=None))


@trigger("lm-head-conflict")
def _(c):
    options = dict(quantize="int4", quantize_lm_head=False, lm_head="int8", progress=None)
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", **options))


@trigger("lm-head-unknown")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", quantize="int4", lm_head="bf16", progress=None))


@trigger("lm-head-blocks-needs-quantize")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", lm_head_block_size=64, progress=None))


@trigger("lm-head-blocks-float")
def _(c):
    options = dict(quantize="int4", lm_head="float", lm_head_block_size=64, progress=None)
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", **options))


@trigger("lm-head-block-size")
def _(c):
    options = dict(quantize="int4", lm_head_block_size=100, progress=None)
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", **options))


@trigger("max-prompt-range")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", max_seq=96, max_prompt=200, progress=None))


@trigger("tensorrt-lowering")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "out", target="tensorrt", lowering="gqa", progress=None))


# ------------------------------------------------------------------------------------------ prompts


@trigger("prompt-float-id")
def _(c):
    return raised(lambda: c.engine.generate([[1.5, 2.7]]), TypeError)


@trigger("prompt-bytes")
def _(c):
    return raised(lambda: c.engine.generate([b"abc"]), TypeError)


@trigger("prompt-none")
def _(c):
    return raised(lambda: c.engine.stream(None), TypeError)


@trigger("prompts-one-string")
def _(c):
    return raised(lambda: c.engine.generate("The for statement"), TypeError)


@trigger("prompts-empty")
def _(c):
    return raised(lambda: c.engine.generate([]))


@trigger("prompt-empty")
def _(c):
    return raised(lambda: c.engine.generate([""]))


@trigger("prompt-too-long")
def _(c):
    return raised(lambda: c.engine.generate([[5] * 97]))


@trigger("token-out-of-vocab")
def _(c):
    return raised(lambda: c.engine.generate([[0, 384]]))


@trigger("no-tokenizer")
def _(c):
    with c.manifest_edit(lambda d: d["tokenizer"].update(has_tokenizer=False)) as art, Engine.load(art) as engine:
        return raised(lambda: engine.generate(["text"]))


@trigger("chat-no-template")
def _(c):
    return raised(lambda: c.engine.chat([{"role": "user", "content": "hi"}]))


# ------------------------------------------------------------------------------------------ parameters


@trigger("max-new-tokens-type")
def _(c):
    return raised(lambda: c.engine.generate([[1, 2]], max_new_tokens=2.5), TypeError)


@trigger("max-new-tokens-range")
def _(c):
    return raised(lambda: c.engine.generate([[1, 2]], max_new_tokens=0))


@trigger("sampling-range")
def _(c):
    return raised(lambda: c.engine.generate([[1, 2]], sampling={"top_p": 2.0}))


@trigger("sampling-float32")
def _(c):
    return raised(lambda: SamplingParams(temperature=1e39))


@trigger("sampling-unknown")
def _(c):
    return raised(lambda: c.engine.generate([[1, 2]], sampling={"temprature": 0.5}))


@trigger("sampling-logit-bias")
def _(c):
    return raised(lambda: SamplingParams(logit_bias={3: 101}))


@trigger("sampling-logit-bias-vocab")
def _(c):
    return raised(lambda: c.engine.generate([[1, 2]], sampling={"temperature": 0, "logit_bias": {99999: 1.0}}))


@trigger("sampling-type")
def _(c):
    return raised(lambda: c.engine.generate([[1, 2]], sampling="greedy"))


@trigger("stop-type")
def _(c):
    return raised(lambda: c.engine.generate([[1, 2]], stop=5))


@trigger("load-threads")
def _(c):
    return raised(lambda: Engine.load(c.artifact, threads=0))


@trigger("load-flag")
def _(c):
    return raised(lambda: Engine.load(c.artifact, verify=1), TypeError)


@trigger("unknown-device")
def _(c):
    return raised(lambda: Engine.load(c.artifact, device="tpu"))


@trigger("rewind-range")
def _(c):
    with c.engine.session() as s:
        s.append([1, 2, 3, 4, 5])
        return raised(lambda: s.rewind(9))


@trigger("prefill-chunk")
def _(c):
    return raised(lambda: c.engine.scheduler(prefill_chunk=2.5), TypeError)


# ------------------------------------------------------------------------------------------ limits and state


@trigger("prefill-continuation-gqa")
def _(c):
    c.engine.prefill([[1, 2, 3], [4, 5, 6]])
    return raised(lambda: c.engine.prefill([[1, 2], [3, 4]], start=[3, 3]))


@trigger("decode-count")
def _(c):
    c.engine.prefill([[1, 2], [3, 4]])
    return raised(lambda: c.engine.decode([1, 2, 3]))


@trigger("decode-no-batch")
def _(c):
    c.engine.generate([[1, 2]], max_new_tokens=1)  # generate takes the rows: the step batch is gone
    return raised(lambda: c.engine.decode([1]), RuntimeError)


@trigger("decode-other-thread")
def _(c):
    c.engine.prefill([[1, 2]])
    seen = []

    def other():
        try:
            c.engine.decode([1])
        except RuntimeError as e:
            seen.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    return seen[0]


@trigger("rows-owned")
def _(c):
    with c.engine.scheduler():
        return raised(lambda: c.engine.generate([[1, 2]]), RuntimeError)


@trigger("scheduler-closed")
def _(c):
    sched = c.engine.scheduler()
    sched.close()
    return raised(lambda: sched.submit([1, 2]), RuntimeError)


@trigger("session-full")
def _(c):
    with c.engine.session() as s:
        return raised(lambda: s.append([5] * 97))


@trigger("session-rows")
def _(c):
    sessions = [c.engine.session() for _ in range(c.engine.max_batch)]
    try:
        return raised(c.engine.session, RuntimeError)
    finally:
        for s in sessions:
            s.close()


@trigger("session-busy")
def _(c):
    with c.engine.session() as s:
        s.append([1, 2, 3])
        stream = s.stream(max_new_tokens=3)
        next(stream)
        try:
            return raised(lambda: s.append([4]), RuntimeError)
        finally:
            stream.close()


@trigger("session-closed")
def _(c):
    s = c.engine.session()
    s.close()
    return raised(lambda: s.append([1]), RuntimeError)


@trigger("session-empty")
def _(c):
    with c.engine.session() as s:
        return raised(lambda: s.generate(max_new_tokens=2))


# ------------------------------------------------------------------------------------------ GPU


@trigger("tensorrt-on-cpu")
def _(c):
    return raised(lambda: Engine.load(c.artifact, backend="tensorrt"))


@trigger("cuda-absent")
def _(c, monkeypatch):
    monkeypatch.setattr(environment, "cuda_gpu", lambda index=0: "no NVIDIA driver (catalog test)")
    return raised(lambda: Engine.load(c.artifact, device="cuda"), environment.DeviceUnavailableError)


@trigger("tensorrt-no-engine")
def _(c, monkeypatch):
    gpu = environment.Gpu(0, "Test GPU", "9.0", 80 << 30, 80 << 30)
    monkeypatch.setattr(environment, "cuda_gpu", lambda index=0: gpu)
    return raised(lambda: Engine.load(c.artifact, device="cuda", backend="tensorrt"), mf.ArtifactError)


@trigger("tensorrt-mismatch")
def _(c):
    record = mf.EngineRecord(
        plan_file="engine.plan",
        plan_sha256="0",
        plan_bytes=1,
        source_graph="prefill",
        tensorrt_version="10.15",
        gpu_name="H100",
        compute_capability="9.0",
        profiles=[],
        timing_cache_file=None,
        strongly_typed=True,
        workspace_bytes=None,
        device_memory_bytes=0,
    )
    check = lambda: mf.check_engine(record, tensorrt_version="10.16", gpu_name="H100", compute_capability="9.0")  # noqa: E731
    return raised(check, mf.ArtifactError)


@trigger("gpu-too-small")
def _(c):
    manifest = mf.read(c.artifact, verify=False)
    return raised(lambda: backends.check_fits(manifest, "ort", manifest.weights.bytes + 1, "Tiny GPU"))


@trigger("build-refusal")
def _(c):
    return environment.build_refusal("cuda-python is not installed (x)", "TensorRT is not installed (y)")


# ------------------------------------------------------------------------------------------ HTTP server


@pytest.fixture(scope="module")
def http(llama_chat_artifact, llama_artifact):
    """TestClients over build_app: the chat artifact (with an API key), and one without a template."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvforge.tools.serve.app import build_app
    from kvforge.tools.serve.serving import ModelServer

    server = ModelServer.load(llama_chat_artifact, threads=1, model_name="m", max_queue=0)
    plain = ModelServer.load(llama_artifact, threads=1, model_name="plain")
    with (
        TestClient(build_app(server, api_key="k")) as client,
        TestClient(build_app(plain)) as plain_client,
        TestClient(build_app(plain, strict_fields=True)) as strict_client,
    ):
        yield server, client, plain_client, strict_client


def answer(response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


KEY = {"Authorization": "Bearer k"}
BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


@trigger("http-400-type")
def _(c, http):
    return answer(http[1].post("/v1/completions", json={**BODY, "max_tokens": 2.0}, headers=KEY), 400)


@trigger("http-400-unknown-field")
def _(c, http):
    body = {**BODY, "model": "plain", "temprature": 1}
    return answer(http[3].post("/v1/completions", json=body), 400)


@trigger("http-400-model")
def _(c, http):
    return answer(http[1].post("/v1/completions", json={**BODY, "model": "gpt-4"}, headers=KEY), 400)


@trigger("http-400-context")
def _(c, http):
    return answer(http[1].post("/v1/completions", json={**BODY, "max_tokens": 1000}, headers=KEY), 400)


@trigger("http-400-unsupported")
def _(c, http):
    return answer(http[1].post("/v1/completions", json={**BODY, "suffix": "}"}, headers=KEY), 400)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@trigger("http-400-functions")
def _(c, http):
    body = {**CHAT, "functions": [{"name": "f", "parameters": {"type": "object"}}]}
    return answer(http[1].post("/v1/chat/completions", json=body, headers=KEY), 400)


@trigger("http-400-forced-tool-format")
def _(c):
    from kvforge.tools.serve import structured
    from kvforge.tools.serve.parsers.mistral import MistralParser
    from kvforge.tools.serve.serving import ServingError

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return raised(lambda: structured.plan(None, tools, "required", None, MistralParser()), ServingError)


@trigger("http-400-template-kwargs")
def _(c, http):
    body = {**CHAT, "chat_template_kwargs": {"messages": []}}
    return answer(http[1].post("/v1/chat/completions", json=body, headers=KEY), 400)


@trigger("http-400-text-only")
def _(c, http):
    body = {**CHAT, "modalities": ["text", "audio"]}
    return answer(http[1].post("/v1/chat/completions", json=body, headers=KEY), 400)


@trigger("http-400-logit-bias-vocab")
def _(c, http):
    body = {**BODY, "logit_bias": {"999999": 1}}
    return answer(http[1].post("/v1/completions", json=body, headers=KEY), 400)


@trigger("http-400-min-tokens")
def _(c, http):
    return answer(http[1].post("/v1/completions", json={**BODY, "max_tokens": 4, "min_tokens": 5}, headers=KEY), 400)


@trigger("http-400-no-template")
def _(c, http):
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    return answer(http[2].post("/v1/chat/completions", json=body), 400)


RESPONSES = {"model": "m", "input": "hi", "max_output_tokens": 2}


def responses_error(http, status: int = 400, path: str = "/v1/responses", **fields) -> str:
    return answer(http[1].post(path, json={**RESPONSES, **fields}, headers=KEY), status)


@trigger("http-404-response")
def _(c, http):
    return answer(http[1].get("/v1/responses/resp_nope", headers=KEY), 404)


@trigger("http-400-responses-item")
def _(c, http):
    return responses_error(http, input=[{"type": "web_search_call", "id": "ws_1"}])


@trigger("http-400-responses-text-only")
def _(c, http):
    part = {"type": "input_image", "image_url": "https://example.com/a.png"}
    return responses_error(http, input=[{"role": "user", "content": [part]}])


@trigger("http-400-responses-tool")
def _(c, http):
    return responses_error(http, tools=[{"type": "web_search"}])


@trigger("http-400-responses-format")
def _(c, http):
    return responses_error(http, text={"format": {"type": "xml"}})


@trigger("http-400-responses-logprobs")
def _(c, http):
    return responses_error(http, top_logprobs=2)


@trigger("http-400-responses-conversation")
def _(c, http):
    return responses_error(http, conversation="conv_1")


@trigger("http-400-responses-background")
def _(c, http):
    return responses_error(http, background=True)


@trigger("http-400-responses-prompt")
def _(c, http):
    return responses_error(http, prompt={"id": "pmpt_1"})


@trigger("http-400-no-score-graph")
def _(c, http):  # the chat artifact is compiled without a score graph
    body = {**BODY, "echo": True, "logprobs": 1}
    return answer(http[1].post("/v1/completions", json=body, headers=KEY), 400)


@trigger("http-400-tokenize")
def _(c, http):
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    return answer(http[1].post("/tokenize", json=body), 400)


@trigger("http-404-model")
def _(c, http):
    return answer(http[1].get("/v1/models/gpt-4", headers=KEY), 404)


@trigger("http-401")
def _(c, http):
    return answer(http[1].post("/v1/completions", json=BODY), 401)


@trigger("http-429")
def _(c, http):
    server = http[0]
    server.in_flight = server.capacity  # every place taken
    try:
        return answer(http[1].post("/v1/completions", json=BODY, headers=KEY), 429)
    finally:
        server.in_flight = 0


@trigger("http-503")
def _(c, http):
    server = http[0]
    server.draining = True
    try:
        return answer(http[1].post("/v1/completions", json=BODY, headers=KEY), 503)
    finally:
        server.draining = False


MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def anthropic_answer(response, status: int) -> str:
    """The message of Anthropic's error object (the /v1/messages routes), checking its shape."""
    assert response.status_code == status, response.text
    assert response.json()["type"] == "error" and response.headers["request-id"] == response.json()["request_id"]
    return response.json()["error"]["message"]


@trigger("http-anthropic-block")
def _(c, http):
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {**MESSAGES, "messages": [{"role": "user", "content": [image]}]}
    return anthropic_answer(http[1].post("/v1/messages", json=body, headers=KEY), 400)


@trigger("http-anthropic-server-tool")
def _(c, http):
    body = {**MESSAGES, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    return anthropic_answer(http[1].post("/v1/messages", json=body, headers=KEY), 400)


@trigger("http-anthropic-tool-choice")
def _(c, http):
    tool = {"name": "f", "input_schema": {"type": "object"}}
    body = {**MESSAGES, "tools": [tool], "tool_choice": {"type": "tool", "name": "x"}}
    return anthropic_answer(http[1].post("/v1/messages", json=body, headers=KEY), 400)


@trigger("http-anthropic-container")
def _(c, http):
    return anthropic_answer(http[1].post("/v1/messages", json={**MESSAGES, "container": "c"}, headers=KEY), 400)


@trigger("http-anthropic-output-format")
def _(c, http):
    body = {**MESSAGES, "output_config": {"format": {"type": "regex"}}}
    return anthropic_answer(http[1].post("/v1/messages", json=body, headers=KEY), 400)


@trigger("http-anthropic-404-model")
def _(c, http):
    body = {**MESSAGES, "model": "claude-opus-5"}
    return anthropic_answer(http[1].post("/v1/messages", json=body, headers={"x-api-key": "k"}), 404)


@trigger("http-anthropic-529")
def _(c, http):
    server = http[0]
    server.draining = True
    try:
        return anthropic_answer(http[1].post("/v1/messages", json=MESSAGES, headers=KEY), 529)
    finally:
        server.draining = False


def cli(argv: list[str]) -> str:
    """stderr of ``kvforge ARGV`` run in-process; it must exit with status 2."""
    from kvforge.tools.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    assert code == 2, (argv, code, err.getvalue())
    return err.getvalue()


@trigger("cli-serve-port")
def _(c):
    return cli(["serve", str(c.artifact), "--port", "70000"])


@trigger("cli-serve-parser-scale-out")
def _(c):
    return cli(["serve", str(c.artifact), "--tool-parser", "hermes", "--ray"])


@trigger("cli-loadtest-timeout")
def _(c):
    return cli(["loadtest", "http://127.0.0.1:9", "--timeout", "0"])


@trigger("cli-usage")
def _(c):
    return cli(["generate", str(c.artifact), "hi", "--max-new-tokens", "2.5"])


@trigger("cli-error")
def _(c):
    return cli(["generate", str(c.tmp / "nope"), "hi"])


# ------------------------------------------------------------------------------------------ KV blocks


def _block(c):
    c.engine.prefill_rows([[0, 5, 6, 7]], [0], first=0)
    return c.engine.export_kv(0, [0, 5, 6, 7])


@trigger("kv-block-foreign")
def _(c):
    block = _block(c)
    foreign = KVBlock({**block.fingerprint, "lowering": "onnx"}, 0, block.token_ids, block.data)
    return raised(lambda: c.engine.import_kv(foreign, 0), KVBlockError)


@trigger("kv-block-too-long")
def _(c):
    block = _block(c)
    return raised(lambda: c.engine.import_kv(KVBlock(block.fingerprint, 94, block.token_ids, block.data), 0))


@trigger("kv-block-corrupted")
def _(c):
    path = _block(c).save(c.tmp / "block.kvb")
    path.write_bytes(path.read_bytes()[:-10])
    return raised(lambda: KVBlock.load(path), KVBlockError)


@trigger("kv-block-not-a-block")
def _(c):
    (c.tmp / "text.kvb").write_text("hello, not a block at all")
    return raised(lambda: KVBlock.load(c.tmp / "text.kvb"), KVBlockError)


@trigger("kv-session-plain-block")
def _(c):
    path = _block(c).save(c.tmp / "plain.kvb")
    return raised(lambda: c.engine.session(restore=path), KVBlockError)


@trigger("kv-block-kv-dtype")
def _(c, kvint8):
    with Engine.load(kvint8, threads=1, prefix_cache=0) as engine:
        return raised(lambda: engine.import_kv(_block(c), 0), KVBlockError)


@trigger("kv-int8-export-view")
def _(c, kvint8):
    with Engine.load(kvint8, threads=1, prefix_cache=0) as engine:
        engine.prefill([[1, 2, 3]])
        return raised(lambda: engine.export_kv(0, [1, 2, 3], view=True))


@trigger("kv-int8-handoff-scales")
def _(c, kvint8):
    from kvforge.runtime.kv.handoff import Handoff

    with Engine.load(kvint8, threads=1, prefix_cache=0) as engine, engine.scheduler() as sched:
        handoff = sched.submit([1, 2, 3], 4, hand_off=True).result(timeout=60).handoff
    return raised(lambda: Handoff.from_parts(handoff.header(), handoff.block.data), KVBlockError)


@trigger("kv-int8-load")
def _(c, kvint8):
    return raised(lambda: Engine.load(kvint8, kv_shared=True))


@trigger("kv-dtype-target")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "kv8", kv_dtype="int8", target="cuda", progress=None))


@trigger("kv-dtype-gqa")
def _(c):
    return raised(lambda: compile_model(c.model_dir, c.tmp / "kv8", kv_dtype="int8", lowering="gqa", progress=None))


@trigger("kv-dtype-state")
def _(c, lfm2):
    source = mf.read(lfm2, verify=False).source["path"]
    return raised(lambda: compile_model(source, c.tmp / "kv8", kv_dtype="int8", max_seq=64, progress=None))


@trigger("prefix-cache-size")
def _(c):
    return raised(lambda: Engine.load(c.artifact, prefix_cache="lots"))


# ------------------------------------------------------------------------------------------ state layers


@trigger("state-kv-shared")
def _(c, lfm2):
    return raised(lambda: Engine.load(lfm2, kv_shared=True))


@trigger("state-gpu")
def _(c, lfm2):
    return raised(lambda: Engine.load(lfm2, device="cuda"))


@trigger("state-block-foreign")
def _(c, lfm2):
    with Engine.load(lfm2, threads=1) as engine:
        engine.prefill([[1, 2, 3]])
        block = engine.export_kv(0, [1, 2, 3])
        other = {name: value[:32] for name, value in block.state.items()}  # another conv width
        foreign = KVBlock(block.fingerprint, 0, block.token_ids, block.data, state=other)
        return raised(lambda: engine.import_kv(foreign, 1), KVBlockError)


@trigger("state-block-missing")
def _(c, lfm2):
    with Engine.load(lfm2, threads=1) as engine:
        engine.prefill([[1, 2, 3]])
        block = engine.export_kv(0, [1, 2, 3], with_state=False)
        return raised(lambda: engine.import_kv(block, 1), KVBlockError)


@trigger("state-block-position")
def _(c, lfm2):
    with Engine.load(lfm2, threads=1) as engine:
        engine.prefill([[1, 2, 3]])
        return raised(lambda: engine.export_kv(0, [1, 2], with_state=True))


@trigger("state-score-ragged")
def _(c, lfm2):
    with Engine.load(lfm2, threads=1) as engine:
        return raised(lambda: engine.score([[1, 2, 3], [4, 5]]))


@trigger("manifest-state-layers")
def _(c, lfm2):
    manifest = json.loads((lfm2 / "manifest.json").read_text())
    manifest["state"] = manifest["state"][:2]  # layer 3 keeps nothing now: allowed (Nemotron-H's MLP blocks)
    manifest["kv_cache"]["layers"] = [1, 4]  # but the model has no layer 4
    return raised(lambda: mf.Manifest.from_dict({k: v for k, v in manifest.items() if k != "format"}), mf.ArtifactError)


# ------------------------------------------------------------------------------------------ the tests


def test_every_row_has_a_trigger_and_every_trigger_a_row():
    assert len(ROWS) >= 30
    assert sorted(set(ROWS) - set(TRIGGERS)) == [], "rows of docs/errors.md without a trigger here"
    assert sorted(set(TRIGGERS) - set(ROWS)) == [], "triggers without a row in docs/errors.md"


@pytest.mark.parametrize("row_id", list(ROWS))
def test_documented_message_is_printed(row_id, ctx, request, monkeypatch):
    fn = TRIGGERS[row_id]
    kwargs = {}
    if "http" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
        kwargs["http"] = request.getfixturevalue("http")
    if "monkeypatch" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
        kwargs["monkeypatch"] = monkeypatch
    if "lfm2" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
        kwargs["lfm2"] = request.getfixturevalue("lfm2_artifact")  # a hybrid artifact (state layers)
    if "kvint8" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
        kwargs["kvint8"] = request.getfixturevalue("llama_int8_artifact")  # an 8-bit KV artifact
    message = fn(ctx, **kwargs)
    assert message, f"{row_id}: no message"
    at = 0
    for piece in (p.strip() for p in ROWS[row_id].split("…")):
        found = message.find(piece, at)
        assert found >= 0, f"{row_id}: documented {piece!r} not in the message {message!r}"
        at = found + len(piece)
