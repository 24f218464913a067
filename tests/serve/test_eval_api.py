"""The evaluation surface of ``kvforge serve``: prompt logprobs on ``/v1/completions`` (``echo`` +
``logprobs``, ``max_tokens: 0``, vLLM's ``prompt_logprobs``), ``/tokenize``, ``/detokenize``,
``/tokenizer_info``, ``GET /v1/models/{id}``, and lm-evaluation-harness run against the real server.

Reference: transformers' logits of the same tiny Llama (``llama_dir``, fp32), log-softmaxed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.conftest import CHATML_TEMPLATE
from tests.helpers import KEY
from tests.tools.test_serve import MODEL, post, running, sse_events

TEXT = "The for statement in Python iterates over the items of any sequence, such as a list or a string"
TOL = 1e-4


@pytest.fixture(scope="module")
def eval_model(llama_dir, tmp_path_factory) -> Path:
    """``llama_dir``'s model with a ChatML template and named special tokens: what both the server's
    artifact and lm-eval's ``--model hf`` load."""
    model = tmp_path_factory.mktemp("eval") / "model"
    shutil.copytree(llama_dir, model)
    config = {
        "chat_template": CHATML_TEMPLATE,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def eval_artifact(eval_model, tmp_path_factory) -> Path:
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("eval") / "artifact"
    compile_model(eval_model, out, max_batch=4, max_seq=256, progress=None)  # with the score graph
    return out


@pytest.fixture(scope="module")
def served(eval_artifact):
    with running(eval_artifact, max_queue=8) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def reference(eval_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(eval_model, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def reference_logprobs(reference, ids: list[int]) -> tuple[list[float], np.ndarray]:
    """transformers' log p(ids[i] | ids[:i]) for i >= 1, and the log-softmax rows ``[n, V]``."""
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1).numpy()
    return [float(rows[i - 1, ids[i]]) for i in range(1, len(ids))], rows


def assert_close(got, want, what: str) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    worst = int(np.argmax(np.abs(got - want)))
    assert np.abs(got - want).max() <= TOL, f"{what}: worst at {worst}: {got[worst]} vs {want[worst]}"


def completion(url: str, **body) -> dict:
    r = post(url, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------------ prompt logprobs


def test_echo_logprobs_equal_transformers_with_and_without_a_prefix_hit(served, reference):
    url, server = served
    ids = server.encode(TEXT)
    want, rows = reference_logprobs(reference, ids)
    server.engine.prefix_pool.clear()
    first = completion(url, prompt=TEXT, echo=True, logprobs=3, max_tokens=0)
    [choice] = first["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert lp["tokens"] == [server.token_text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert_close(lp["token_logprobs"][1:], want, "prompt logprobs vs transformers")
    for i in range(1, len(ids)):  # the 3 likeliest tokens, and the prompt's own
        top3 = np.argsort(-rows[i - 1])[:3]
        expected = {server.token_text(int(t)): float(rows[i - 1, t]) for t in top3}
        expected.setdefault(server.token_text(ids[i]), float(rows[i - 1, ids[i]]))
        assert lp["top_logprobs"][i].keys() == expected.keys()
        assert_close(list(lp["top_logprobs"][i].values()), list(expected.values()), f"top_logprobs[{i}]")
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    assert first["usage"]["prompt_tokens"] == len(ids) and first["usage"]["completion_tokens"] == 0

    # The scored prompt's KV went to the prefix pool: a generation from it starts from a hit ...
    greedy = completion(url, prompt=TEXT, max_tokens=2, temperature=0)
    assert greedy["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    # ... and scoring again, with the pool holding the prompt, gives the same numbers.
    again = completion(url, prompt=TEXT, echo=True, logprobs=3, max_tokens=0)
    assert again["choices"][0]["logprobs"] == lp


def test_lm_eval_request_shape_batched_token_prompts(served, reference):
    """What lm-eval's local-completions sends: token-id prompts, batched, echo, logprobs 1, max_tokens 1."""
    url, server = served
    prompts = [server.encode(t) for t in (TEXT, "A list is a mutable", "Question: what is a tuple? Answer:")]
    body = completion(url, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, body["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
        assert lp["token_logprobs"][0] is None
        assert_close(lp["token_logprobs"][1 : len(ids)], reference_logprobs(reference, ids)[0], "batched prompt")
        assert lp["text_offset"][len(ids)] == len(server.tokenizer.decode(ids))  # generated: after the prompt text
        for i in range(1, len(ids)):
            assert max(lp["top_logprobs"][i].values()) >= lp["token_logprobs"][i]
    assert body["usage"]["completion_tokens"] == 3


def test_prompt_logprobs_extension_and_the_openai_client(served, reference):
    url, server = served
    ids = server.encode("A list is a mutable sequence")
    want, rows = reference_logprobs(reference, ids)
    body = completion(url, prompt=ids, prompt_logprobs=2, max_tokens=1, temperature=0)
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        own = entries[i][str(ids[i])]
        assert abs(own["logprob"] - want[i - 1]) <= TOL
        assert own["rank"] == 1 + int((rows[i - 1] > rows[i - 1, ids[i]]).sum())
        assert own["decoded_token"] == server.token_text(ids[i])
        best = entries[i][str(int(np.argmax(rows[i - 1])))]
        assert best["rank"] == 1
    assert body["choices"][0]["logprobs"] is None  # prompt_logprobs alone: no echo

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    echoed = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert echoed.choices[0].text == server.tokenizer.decode(ids)
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    assert_close(echoed.choices[0].logprobs.token_logprobs[1:], want, "openai client")


def test_echo_without_logprobs_and_streamed_prompt_logprobs(served):
    url, _ = served
    body = completion(url, prompt=["Hello there", "A list"], echo=True, max_tokens=0, n=2)
    assert [c["text"] for c in body["choices"]] == ["Hello there"] * 2 + ["A list"] * 2
    assert all(c["logprobs"] is None for c in body["choices"])

    whole = completion(url, prompt=TEXT, echo=True, logprobs=1, max_tokens=3, temperature=0)["choices"][0]
    r = post(
        url,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": TEXT,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
        },
    )
    events = sse_events(r.text.splitlines())
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"] == TEXT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert joined == whole["logprobs"]["token_logprobs"]


def test_prompt_logprob_refusals(served, llama_chat_artifact):
    url, _ = served
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    with running(llama_chat_artifact) as (chat_url, _):  # compiled without a score graph
        r = post(chat_url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": True, "logprobs": 1})
        assert r.status_code == 400
        assert "no score graph" in r.json()["error"]["message"] and r.json()["error"]["param"] == "logprobs"
        streamed = {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 0, "stream": True}
        assert post(chat_url, "/v1/completions", streamed).status_code == 400  # refused before the stream starts


# ------------------------------------------------------------------------------ tokenizer routes


def test_tokenize_detokenize_round_trip(served):
    url, server = served
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == server.encode(TEXT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    assert body["token_strs"] == [server.token_text(t) for t in body["tokens"]]
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": TEXT}

    special = httpx.post(url + "/tokenize", json={"prompt": "<|endoftext|>hi", "add_special_tokens": False}).json()
    assert special["tokens"][0] == 0  # the special token itself, as lm-eval's remote tokenizer reads the eos id
    assert httpx.post(url + "/detokenize", json={"tokens": special["tokens"]}).json()["prompt"] == "<|endoftext|>hi"


def test_tokenize_messages_through_the_chat_template(served):
    url, server = served
    messages = [{"role": "user", "content": "What is a list?"}]
    body = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    rendered = "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    assert body["tokens"] == server.encode(rendered, special=False)
    # the same ids /v1/chat/completions prefills: its usage counts them
    chat = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    opened = httpx.post(
        url + "/tokenize",
        json={
            "messages": [*messages, {"role": "assistant", "content": "A list"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ).json()
    assert server.tokenizer.decode(opened["tokens"], skip_special_tokens=False).endswith(
        "<|im_start|>assistant\nA list"
    )


def test_tokenizer_route_errors(served):
    url, _ = served
    both = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "a"}]})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={}).status_code == 400
    wrong = httpx.post(url + "/tokenize", json={"model": "gpt-4", "prompt": "a"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(url + "/detokenize", json={"tokens": [1, 10_000]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_tokenizer_info_and_model_by_id(served):
    url, _ = served
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] == "<|endoftext|>"
    assert info["chat_template"] == CHATML_TEMPLATE and info["model_max_length"] == 256
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found" and missing.value.status_code == 404
    assert httpx.get(url + "/v1/models/" + MODEL).status_code == 401  # the /v1 key still applies


# ---------------------------------------------------------------------------------------- lm-eval

DOCS = [
    {"question": "The for statement iterates over", "choices": ["a sequence", "the moon", "nothing"], "answer": 0},
    {"question": "A list is a", "choices": ["mutable sequence", "fish", "number", "loop"], "answer": 0},
    {"question": "Python is a programming", "choices": ["language", "snake"], "answer": 1},
    {"question": "Question: what is a tuple? Answer:", "choices": ["immutable", "mutable", "red"], "answer": 2},
]
QUESTIONS = [{"question": "What is a list?"}, {"question": "Name a loop."}]


def _task_dir(root: Path) -> Path:
    """Two tasks from local jsonl files (the ``json`` builder of ``datasets``: nothing from a hub)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in QUESTIONS))
    (root / "kvf_mc.yaml").write_text(
        f"""task: kvf_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    (root / "kvf_gen.yaml").write_text(
        f"""task: kvf_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "x"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )
    return root


def lm_eval(root: Path, tasks: str, model: str, model_args: str, *extra: str) -> list[dict]:
    """``lm_eval run`` in a process of its own (offline); its logged samples, in doc order."""
    out = root / f"out-{model}"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(root / "hf"),
        "OPENAI_API_KEY": KEY,
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        tasks,
        "--include_path",
        str(root),
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    [samples] = list(out.rglob(f"samples_{tasks}_*.jsonl"))
    return sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_lm_eval_local_completions_equals_hf(served, eval_model, tmp_path):
    pytest.importorskip("lm_eval")
    url, _ = served
    root = _task_dir(tmp_path / "tasks")
    api = lm_eval(
        root,
        "kvf_mc",
        "local-completions",
        f"model={MODEL},base_url={url}/v1/completions,max_retries=1",
        "--batch_size",
        "4",
    )
    hf = lm_eval(root, "kvf_mc", "hf", f"pretrained={eval_model},dtype=float32", "--device", "cpu", "--batch_size", "4")
    assert len(api) == len(hf) == len(DOCS)
    for a, h in zip(api, hf):
        got = [float(r[0][0]) for r in a["resps"]]  # each choice's loglikelihood (logged as text)
        want = [float(r[0][0]) for r in h["resps"]]
        assert np.abs(np.array(got) - np.array(want)).max() <= 1e-3, (a["doc_id"], got, want)
        assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in h["resps"]]  # is_greedy
        assert a["acc"] == h["acc"]


@pytest.mark.slow
def test_lm_eval_local_chat_completions_generate_until(served, tmp_path):
    pytest.importorskip("lm_eval")
    url, _ = served
    root = _task_dir(tmp_path / "tasks")
    samples = lm_eval(
        root,
        "kvf_gen",
        "local-chat-completions",
        f"model={MODEL},base_url={url}/v1/chat/completions,max_retries=1",
        "--apply_chat_template",
    )
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    for doc, sample in zip(QUESTIONS, samples):
        direct = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": doc["question"]}],
            max_tokens=6,
            temperature=0,
            stop=["\n"],
        )
        assert sample["resps"][0][0] == direct.choices[0].message.content
