"""The parser families through the real server (uvicorn, the bundled model, the official ``openai``
client).

Proves: with the ``think`` reasoning parser, the reasoning goes to ``message.reasoning_content``
(and streamed to ``delta.reasoning_content``), never into ``content``, whether the model opens
``<think>`` or the chat template did; ``chat_template_kwargs`` (``enable_thinking``) and
``reasoning_effort`` reach the template and change where the output starts; forced tool calls
(``tool_choice`` named or required) are written in the family's own format through its grammar
(Qwen3-Coder XML, Llama 3 JSON; Mistral v11 and gpt-oss harmony, whose markers are special tokens
forced as such, on a tiny model whose tokenizer has them) and come back as valid OpenAI calls,
streamed equal to whole with the arguments in pieces; a Mistral or harmony parser on a model whose
tokenizer lacks those markers refuses a forced call with a 400 before anything runs. The model's
output is forced by a ``grammar`` response format, so every expected string is exact.
"""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import KEY, make_llama, save_tokenizer
from tests.tools.test_serve import MODEL, running

pytest.importorskip("llguidance")

# ChatML, opening <think> itself when thinking is asked for (enable_thinking, or a high reasoning_effort).
THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking or reasoning_effort == 'high' %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Say hello."}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}, "unit": {"enum": ["h", "m"]}},
            "required": ["zone", "unit"],
            "additionalProperties": False,
        },
    },
}


def forced(text: str) -> dict:
    """A response format whose grammar admits exactly ``text``."""
    return {"type": "grammar", "grammar": f"start: {json.dumps(text)}\n"}


@pytest.fixture(scope="module")
def think_artifact(tiny_artifact, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-think") / "artifact"
    shutil.copytree(tiny_artifact, out)
    (out / "chat_template.jinja").write_text(THINK_TEMPLATE, encoding="utf-8")
    return out


# The markers of Mistral's and harmony's calls, special tokens of the tiny model below.
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>"]
ENDS = ["<|call|>", "<|return|>"]  # harmony's end-of-sequence tokens
# gpt-oss's shape: the generation prompt is <|start|>assistant, the model writes from <|channel|> on. Both
# templates read tools (their names only: the tiny tokenizer spends a token per byte or two).
HARMONY_TEMPLATE = (
    "{% if tools %}{{ '<|start|>developer<|message|>functions:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
    "{% endfor %}{{ '<|end|>' }}{% endif %}"
    "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% if tools %}{{ '[AVAILABLE_TOOLS]' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}{% endfor %}"
    "{{ '[/AVAILABLE_TOOLS]' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] + '<|endoftext|>' }}"
    "{% else %}{{ '[INST]' + m['content'] + '[/INST]' }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def marker_artifacts(tmp_path_factory):
    """A tiny random Llama (384 ids) whose tokenizer has the markers as special tokens (after its
    BPE vocabulary), ``<|call|>`` and ``<|return|>`` among its eos ids; compiled with each family's
    chat template: {"mistral": artifact, "harmony": artifact}."""
    from tokenizers import Tokenizer
    from transformers import GenerationConfig

    from kvforge.compile import compile_model

    model = make_llama(tmp_path_factory.mktemp("markers") / "model", max_position_embeddings=512)
    save_tokenizer(model, 320)  # room below the model's 384 ids for the markers
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.add_special_tokens([*MARKERS, *ENDS])
    tok.save(str(model / "tokenizer.json"))
    eos = [0, *(tok.token_to_id(t) for t in ENDS)]
    assert max(eos) < 384
    GenerationConfig(eos_token_id=eos, bos_token_id=0, pad_token_id=0).save_pretrained(model)
    out = {}
    for family, template in (("mistral", MISTRAL_TEMPLATE), ("harmony", HARMONY_TEMPLATE)):
        config = {"chat_template": template, "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        out[family] = tmp_path_factory.mktemp("artifacts") / f"markers-{family}"
        compile_model(model, out[family], max_batch=2, max_seq=512, score_graph=False, progress=None)
    return out


@pytest.fixture(scope="module")
def served(think_artifact):
    with running(think_artifact, reasoning_parser="think") as (url, server):
        yield url, server


def ask(client, output: str, stream: bool = False, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format=forced(output),
        stream=stream,
        **extra,
    )


@pytest.mark.parametrize(
    ("output", "extra"),
    [
        ("<think>\nThe user greets me.\n</think>\n\nHello there!", {}),  # the model opens <think>
        (
            "The user greets me.\n</think>\n\nHello there!",
            {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
        ),
        ("The user greets me.\n</think>\n\nHello there!", {"reasoning_effort": "high"}),
    ],
)
def test_reasoning_is_separated_whole_and_streamed(client, output, extra):
    r = ask(client, output, **extra)
    message = r.choices[0].message
    assert message.reasoning_content == "The user greets me."
    assert message.content == "Hello there!"
    reasoning, content = [], []
    for chunk in ask(client, output, stream=True, **extra):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
    assert "".join(reasoning) == "The user greets me." and "".join(content) == "Hello there!"
    assert sum(bool(piece) for piece in reasoning) > 1, "the reasoning streams in pieces"


def test_without_thinking_there_is_no_reasoning(client):
    # The template did not open <think>, and the model did not write it: all content.
    message = ask(client, "Hello </think> there").choices[0].message
    assert message.reasoning_content is None and message.content == "Hello </think> there"


def test_forced_calls_after_an_opened_think_are_calls(client):
    # The template opened <think>, but the grammar of calls constrains the output from its first token.
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = r.choices[0].message
    assert message.reasoning_content is None and [c.function.name for c in message.tool_calls] == ["get_time"]


def test_reserved_template_variables_are_400(served):
    url, _ = served
    body = {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"messages": []}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "may not set messages" in r.json()["error"]["message"]


@pytest.mark.parametrize("family", ["qwen3_coder", "llama3_json", "mistral", "harmony"])
def test_forced_calls_are_written_in_the_familys_format(request, think_artifact, family):
    special = family in ("mistral", "harmony")
    artifact = request.getfixturevalue("marker_artifacts")[family] if special else think_artifact
    with running(artifact, tool_parser=family, reasoning_parser="none") as (url, server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        # The tiny tokenizer writes harmony's header in ~30 tokens, and a random model takes the blanks JSON allows.
        common = dict(model=MODEL, messages=MESSAGES, tools=[TOOL], max_tokens=240 if special else 80, temperature=0)
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            r = client.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, **common)
            [call] = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
            assert r.choices[0].message.content is None
        if special:  # the markers are the special tokens themselves, not their text spelled out
            r = client.chat.completions.create(tool_choice="required", logprobs=True, **common)
            tokens = [t.token for t in r.choices[0].logprobs.content]
            expected = {
                "mistral": ["[TOOL_CALLS]", "[ARGS]"],
                "harmony": ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"],
            }[family]
            assert [t for t in tokens if t in (*MARKERS, *ENDS)] == expected, tokens
        streamed, pieces = ["", ""], 0
        for chunk in client.chat.completions.create(
            tool_choice="required", parallel_tool_calls=False, stream=True, **common
        ):
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                streamed[0] += d.function.name or ""
                streamed[1] += d.function.arguments or ""
                pieces += bool(d.function.arguments)
        assert streamed == ["get_time", call.function.arguments] and pieces > 1
        assert server.chat_format.tool_parser == family


@pytest.mark.parametrize("family", ["mistral", "harmony"])
def test_a_tokenizer_without_the_markers_refuses_forced_calls(think_artifact, family):
    # The bundled model's tokenizer has no [TOOL_CALLS] nor <|channel|> token: no grammar of those formats.
    with running(think_artifact, tool_parser=family) as (url, _):
        body = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL], "tool_choice": "required"}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        message = r.json()["error"]["message"]
        assert f"({family}), which is written with special tokens that this model's tokenizer does not have" in message


def test_cli_flags_override_the_manifest(think_artifact):
    """``kvforge serve --reasoning-parser think`` on an artifact whose manifest records none."""
    from tests.tools.test_serve import free_port, start_cli_server

    assert json.loads((think_artifact / "manifest.json").read_text())["reasoning_parser"] is None
    port = free_port()
    args = [str(think_artifact), "--served-model-name", MODEL, "--api-key", KEY, "--threads", "1"]
    proc = start_cli_server([*args, "--tool-parser", "hermes", "--reasoning-parser", "think"], port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        message = ask(client, "<think>\nWhy not.\n</think>\n\nHi!").choices[0].message
        assert (message.reasoning_content, message.content) == ("Why not.", "Hi!")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
