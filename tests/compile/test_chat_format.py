"""Choosing the tool-call and reasoning parsers at compile time (compile/chat_format.py), and the
manifest fields that record them.

Proves: snippets of real chat templates (the parts that write tool calls and thinking: Qwen2.5,
Qwen3, Qwen3-Coder, Llama 3.1/3.2, Mistral v3 and v11, gpt-oss, DeepSeek-R1 distills, SmolLM3,
SmolLM2) select the family's parsers; an artifact directory's files are read as compile copies
them (``chat_template.jinja``, a list ``chat_template``, special tokens); every name a manifest may
record is a parser the server has; a manifest without the fields (compiled before them) loads as
hermes with no reasoning, and a foreign name is refused naming the field; ``serve``'s overrides win.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kvforge.compile.chat_format import detect, detect_artifact
from kvforge.graphs import manifest as mf
from kvforge.tools.serve.parsers import REASONING_PARSERS, TOOL_PARSERS, ChatFormat

QWEN25 = (
    "{%- if tools %}# Tools\\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>{%- endif %}'
)
QWEN3 = QWEN25 + (
    "{%- if message.role == 'assistant' and reasoning_content %}{{ '<think>\\n' + reasoning_content.strip('\\n') "
    "+ '\\n</think>\\n\\n' }}{%- endif %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
QWEN3_CODER = (
    "{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}"
    "{{- args_value }}{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
)
LLAMA31 = (
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if builtin_tools is defined %}"
    "{{- '<|python_tag|>' + tool_call.name + '.call(' }}{%- else %}{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
    "{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{%- endif %}"
)
LLAMA32 = (
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}{{- 'Respond in the format {\"name\": function name, "
    '"parameters": dictionary of argument name and its value}.\' }}'
)
MISTRAL_V3 = "{%- if tools %}[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}{{ '[TOOL_CALLS] ' }}"
MISTRAL_V11 = "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}"
GPT_OSS = (
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}"
    "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}"
    "{{- '<|start|>assistant to=' + 'functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}"
)
R1_DISTILL = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
SMOLLM3 = "{%- if reasoning_mode == '/think' -%}{{ '<think>\\n' }}{%- endif -%}<tool_call>"
SMOLLM2 = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"


@pytest.mark.parametrize(
    ("template", "tokens", "expected"),
    [
        (QWEN25, (), ("hermes", None)),
        (QWEN3, (), ("hermes", "think")),
        (QWEN3_CODER, (), ("qwen3_coder", None)),
        (LLAMA31, (), ("llama3_json", None)),
        (LLAMA32, (), ("llama3_json", None)),
        (MISTRAL_V3, (), ("mistral", None)),
        (MISTRAL_V11, ("[TOOL_CALLS]", "[ARGS]"), ("mistral", None)),
        ("{{ messages[0].content }}", ("[TOOL_CALLS]",), ("mistral", None)),
        (GPT_OSS, (), ("harmony", "harmony")),
        (R1_DISTILL, (), ("hermes", "think")),
        (SMOLLM3, (), ("hermes", "think")),
        (SMOLLM2, (), ("hermes", None)),
        (None, (), ("hermes", None)),
    ],
)
def test_templates_select_their_family(template, tokens, expected):
    assert detect(template, tokens) == expected


def test_artifact_files_are_read_as_compile_copies_them(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "default", "template": SMOLLM2}, {"name": "tool_use", "template": QWEN3}]}
        )
    )
    assert detect_artifact(tmp_path) == ("hermes", "think")  # a named template's markup counts
    (tmp_path / "chat_template.jinja").write_text(GPT_OSS)
    assert detect_artifact(tmp_path)[0] == "harmony"
    other = tmp_path / "mistral"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"content": "[TOOL_CALLS]", "special": True}]}))
    assert detect_artifact(other) == ("mistral", None)
    assert detect_artifact(tmp_path / "missing") == ("hermes", None)


def test_every_recordable_name_is_a_server_parser():
    assert set(mf.TOOL_PARSERS) == set(TOOL_PARSERS)
    assert set(mf.REASONING_PARSERS) == set(REASONING_PARSERS)


def test_manifest_fields_default_refuse_and_are_overridden(llama_artifact, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(llama_artifact, out)
    data = json.loads((out / "manifest.json").read_text())
    assert data["tool_parser"] == "hermes" and data["reasoning_parser"] is None  # written by this compile
    for key in ("tool_parser", "reasoning_parser"):
        data.pop(key)  # an artifact compiled before the fields existed
    (out / "manifest.json").write_text(json.dumps(data))
    m = mf.read(out)
    assert (m.tool_parser, m.reasoning_parser) == ("hermes", None)
    assert ChatFormat.choose(m) == ChatFormat("hermes", None)
    assert ChatFormat.choose(m, "qwen3_coder", "think") == ChatFormat("qwen3_coder", "think")
    (out / "manifest.json").write_text(json.dumps({**data, "reasoning_parser": "harmony"}))
    assert ChatFormat.choose(mf.read(out), reasoning_parser="none") == ChatFormat("hermes", None)
    (out / "manifest.json").write_text(json.dumps({**data, "tool_parser": "xml"}))
    with pytest.raises(mf.ArtifactError, match="tool_parser is 'xml', expected one of hermes, llama3_json"):
        mf.read(out)
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        ChatFormat("xml")
