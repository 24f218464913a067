"""Tool-call and reasoning parsers per model family (tools/serve/parsers/).

Proves, on text in each family's documented format (Hermes, Llama 3 JSON, both Mistral forms,
Qwen3-Coder XML, gpt-oss harmony; ``<think>`` reasoning opened by the model or by the template):
the whole parse gives the expected reasoning, content and calls; streamed, split at every
character boundary (one character per piece, and every two-piece split), the deltas join to the
whole parse; and every prefix's split extends the previous one's (the promise the stream rests on).
"""

from __future__ import annotations

import json

import pytest

from kvforge.tools.serve.parsers import ChatFormat, OutputParser, Parsed
from kvforge.tools.serve.parsers.base import Call

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        },
    },
}


def streamed(parser: OutputParser, pieces: list[str]) -> Parsed:
    """What a client rebuilds from the deltas of ``pieces`` fed one by one."""
    stream = parser.stream()
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    reasoning = "".join(d.reasoning for d in deltas if d.reasoning)
    content = "".join(d.content for d in deltas if d.content)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is not None:
            if d.name is not None:
                assert d.index not in calls and d.id, "a call's first piece carries its id and name, once"
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments or ""
    return Parsed(reasoning or None, content or None, [Call(n, a) for n, a in calls.values()])


def assert_prefix_promise(parser: OutputParser, text: str) -> None:
    before = parser.split("", final=False)
    for k in range(1, len(text) + 2):
        now = parser.split(text[:k], final=k > len(text))
        for old, new, what in ((before[0], now[0], "reasoning"), (before[1], now[1], "content")):
            assert new.startswith(old), f"{what} of {text[:k]!r}: {new!r} does not extend {old!r}"
        assert len(now[2]) >= len(before[2]), f"calls vanished at {text[:k]!r}"
        for old, new in zip(before[2], now[2]):
            assert new.name == old.name and new.arguments.startswith(old.arguments), (text[:k], old, new)
        before = now


def check(parser: OutputParser, text: str, reasoning, content, calls) -> None:
    whole = parser.parse(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    for c in whole.calls:
        json.loads(c.arguments)
    key = (whole.reasoning or None, whole.content or None, [(c.name, c.arguments) for c in whole.calls])
    for pieces in [list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]:
        got = streamed(parser, pieces)
        assert (got.reasoning, got.content, [(c.name, c.arguments) for c in got.calls]) == key, pieces
    assert_prefix_promise(parser, text)


def tools(name: str, reasoning: str | None = None, prompt: str = "") -> OutputParser:
    return ChatFormat(name, reasoning).output([WEATHER_TOOL], prompt=prompt, parse_calls=True)


# --------------------------------------------------------------------------------------- hermes

HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (HERMES_ONE, None, [("get_weather", '{"city": "Paris", "days": 3}')]),
        (
            "Let me check.\n" + HERMES_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
            "Let me check.",
            [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")],
        ),
        ("<tool_call>not json</tool_call> and <tool_ text", "<tool_call>not json</tool_call> and <tool_ text", []),
        ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', None, [("f", '{"x": 1}')]),
        ("plain answer\n", "plain answer\n", []),
    ],
)
def test_hermes(text, content, calls):
    check(tools("hermes"), text, None, content, calls)


def test_hermes_cut_off_call_is_an_incomplete_call():
    parsed = tools("hermes").parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert parsed.content is None and [(c.name, c.arguments, c.complete) for c in parsed.calls] == [
        ("get_weather", '{"city": "Pa', False)
    ]


# ---------------------------------------------------------------------------------- llama3_json


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": 1}}',
            None,
            [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": 1}')],
        ),
        ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
        ("The weather is fine.", "The weather is fine.", []),
    ],
)
def test_llama3_json(text, content, calls):
    check(tools("llama3_json"), text, None, content, calls)


# -------------------------------------------------------------------------------------- mistral


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {}}]',
            None,
            [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
        ),
        (
            'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": 1}',
            "Sure.",
            [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": 1}')],
        ),
        ("No tools [TOOL here", "No tools [TOOL here", []),
    ],
)
def test_mistral(text, content, calls):
    check(tools("mistral"), text, None, content, calls)
    assert len(tools("mistral").call_id()) == 9


# ---------------------------------------------------------------------------------- qwen3_coder

QWEN_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (QWEN_CALL, None, [("get_weather", '{"city": "New York", "days": 3, "metric": true}')]),
        (
            "I will look.\n" + QWEN_CALL + "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
            "I will look.",
            [("get_weather", '{"city": "New York", "days": 3, "metric": true}'), ("get_time", "{}")],
        ),
        (
            '<tool_call>\n<function=get_weather>\n<parameter=city>\nline "1"\nline <2>\n</parameter>\n'
            "</function>\n</tool_call>",
            None,
            [("get_weather", '{"city": "line \\"1\\"\\nline <2>"}')],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nnull\n</parameter>\n"
            "<parameter=note>\nnu\n</parameter>\n</function>\n</tool_call>",
            None,
            [("get_weather", '{"city": null, "note": "nu"}')],
        ),
    ],
)
def test_qwen3_coder(text, content, calls):
    check(tools("qwen3_coder"), text, None, content, calls)


# -------------------------------------------------------------------------------------- harmony

RECIPIENT_FIRST = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": 1}<|call|>'
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [
        (ANALYSIS + CALL, "The user wants the weather. Call the tool.", None, [("get_weather", '{"city": "Paris"}')]),
        (
            ANALYSIS + CALL + "<|call|>",
            "The user wants the weather. Call the tool.",
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.",
            "The user wants the weather. Call the tool.",
            "It is sunny in Paris.",
            [],
        ),
        (
            "<|channel|>analysis<|message|>Think.<|end|>" + RECIPIENT_FIRST,
            "Think.",
            None,
            [("get_time", '{"zone": 1}')],
        ),
        ("no markup at all", None, "no markup at all", []),
        (
            '<|channel|>commentary to=browser.search<|message|>{"q": 1}<|call|>'
            "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>",
            None,
            "Checking.",
            [],
        ),
    ],
)
def test_harmony(text, reasoning, content, calls):
    check(tools("harmony", "harmony"), text, reasoning, content, calls)


def test_harmony_without_tools_still_separates_channels():
    parser = ChatFormat("harmony", "harmony").output(None, parse_calls=False)
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    check(parser, text, "The user wants the weather. Call the tool.", "Sunny.", [])


# ---------------------------------------------------------------------------------- think tags


@pytest.mark.parametrize(
    ("prompt", "text", "reasoning", "content"),
    [
        ("<|im_start|>assistant\n", "<think>\nThe user says hi.\n</think>\n\nHello!", "The user says hi.", "Hello!"),
        ("<｜Assistant｜><think>\n", "The user says hi.\n</think>\n\nHello!", "The user says hi.", "Hello!"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello <b>there</b>!", None, "Hello <b>there</b>!"),
        ("<|im_start|>assistant\n", "<think>\nStill thinking when cut", "Still thinking when cut", None),
    ],
)
def test_think(prompt, text, reasoning, content):
    parser = ChatFormat("hermes", "think").output(None, prompt=prompt, parse_calls=False)
    check(parser, text, reasoning, content, [])


def test_think_then_hermes_call():
    text = "<think>I should call get_weather.</think>\n" + HERMES_ONE
    check(
        tools("hermes", "think"),
        text,
        "I should call get_weather.",
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    )


# ------------------------------------------------------------------------- special-token markup


def test_special_token_markup_is_read_with_special_tokens_kept(tmp_path):
    """Mistral's markers are special tokens: the runtime's text drops them, the parser's keeps them
    (the end-of-sequence id left out), piece by piece as whole."""
    from tokenizers import Tokenizer as HFTokenizer

    from kvforge.runtime.tokenizer import Tokenizer
    from kvforge.tools.serve.parsers.text import OutputText
    from tests.conftest import BUNDLED_MODEL

    hf = HFTokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    hf.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path / "tokenizer.json")
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    ids = [*tok.encode(text, add_special_tokens=False), 0]  # 0: the bundled model's eos
    assert "[TOOL_CALLS]" not in tok.decode(ids)  # what the runtime's text holds
    kept = OutputText(tok, [0], keep_special=True)
    assert "".join(kept.piece("", [i]) for i in ids) + kept.flush() == text
    assert kept.whole(None, ids) == text
    plain = OutputText(tok, [0], keep_special=False)
    assert plain.piece("runtime text", ids) == "runtime text" and plain.whole("runtime", ids) == "runtime"
    parsed = ChatFormat("mistral").output([WEATHER_TOOL], parse_calls=True).parse(kept.whole(None, ids))
    assert parsed.content == "Sure." and [(c.name, c.arguments) for c in parsed.calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert ChatFormat("mistral").needs_special_tokens and not ChatFormat("hermes", "think").needs_special_tokens


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "qwen3_coder", "harmony"])
def test_what_a_parser_writes_it_reads_back(family):
    """``write`` (the history of a template that renders no tools, the fallback prompt's example) is
    the family's own format: two calls written and joined parse back to the same two calls."""
    tool = ChatFormat(family).tool([WEATHER_TOOL])
    calls = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]
    text = tool.separator.join(tool.write(name, args) for name, args in calls)
    check(ChatFormat(family).output([WEATHER_TOOL], parse_calls=True), text, None, None, calls)


MARKERS = ["[TOOL_CALLS]", "[ARGS]", "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"]


@pytest.mark.parametrize("family", ["mistral", "harmony"])
def test_the_forced_grammar_of_special_token_markup_writes_the_markers_as_tokens(tmp_path, family):
    """Mistral's and harmony's grammars force each marker as its token id: the tokens of what
    ``write`` writes (harmony: after the prompt's ``<|start|>assistant``) are accepted one by one and
    end the grammar; the marker spelled out in plain text is refused; without a tokenizer that has
    the markers as tokens there is no grammar."""
    llg = pytest.importorskip("llguidance")
    from tokenizers import Tokenizer as HFTokenizer

    from kvforge.runtime.constraints import compile_checked
    from kvforge.runtime.tokenizer import Tokenizer
    from kvforge.tools.serve import structured
    from tests.conftest import BUNDLED_MODEL

    hf = HFTokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    hf.add_special_tokens(MARKERS)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path / "tokenizer.json")
    schemas = {"get_weather": WEATHER_TOOL["function"]["parameters"], "get_time": {"type": "object"}}
    parser = ChatFormat(family).tool([WEATHER_TOOL], tok.token_to_id)
    grammar = structured._calls_grammar(schemas, ["get_weather", "get_time"], False, parser, close=True)
    lltok = llg.LLTokenizer(hf.to_str(), n_vocab=tok.vocab_size, eos_token=[0])

    def matcher():
        return llg.LLMatcher(lltok, compile_checked("grammar", grammar), log_level=0)

    written = parser.write("get_weather", '{"city": "Paris", "days": 3}').removeprefix("<|start|>assistant")
    ids = tok.encode(written, add_special_tokens=False)
    assert {tok.token_to_id(m) for m in MARKERS} & set(ids), "the markers are tokens of what is written"
    m = matcher()
    for i in ids:
        assert m.consume_token(i), (tok.decode([i], skip_special_tokens=False), m.get_error())
    assert m.is_stopped()
    spelled = HFTokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).encode(written).ids  # markers as text
    assert matcher().validate_tokens(spelled) < len(spelled)
    assert ChatFormat(family).tool([WEATHER_TOOL]).grammar(schemas, ["get_time"], False) is None
    plain = Tokenizer(BUNDLED_MODEL / "tokenizer.json")
    assert ChatFormat(family).tool([WEATHER_TOOL], plain.token_to_id).grammar(schemas, ["get_time"], False) is None
