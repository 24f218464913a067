"""runtime/chat.py: chat templates render exactly as transformers' apply_chat_template.

Proves, on tiny tokenizer directories written here with six real-world template styles (Qwen2
ChatML with a default system prompt and tools via ``tojson``; Llama-3 with ``bos_token``, header ids,
``strftime_now`` and an AddedToken-dict bos; Llama-2/Mistral ``[INST]`` with ``raise_exception`` and
tokens from special_tokens_map.json; Gemma ``<start_of_turn>`` in tokenizer_config's list form with a
``tool_use`` variant; Phi-3 multi-line relying on trim_blocks/lstrip_blocks; a template using
namespace, loop controls, ``{% generation %}``, ``dict()``, reasoning fields and a custom variable):
(1) ``ChatTemplate.render`` equals ``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages,
tokenize=False, add_generation_prompt=...)`` for multi-turn conversations with a system message, with
and without the generation prompt; (2) ``Tokenizer.encode(rendered, add_special_tokens=False)`` equals
``apply_chat_template(tokenize=True)`` (a tokenizer whose post-processor adds a BOS shows why False);
(3) a directory without a template gives None / a ChatTemplateError saying the model has no chat
template and to use generate() with a plain prompt; (4) a template's ``raise_exception`` and sandbox
refusals become ChatTemplateError carrying the template's message, where transformers raises too.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from kvforge.runtime import ChatTemplate, ChatTemplateError, Tokenizer
from tests.helpers import TEXT

QWEN2 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.function.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

GEMMA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""
GEMMA_TOOLS = r"""{{ bos_token }}<start_of_turn>tools
{% for t in tools %}{{ t.name }};{% endfor %}<end_of_turn>
{% for m in messages %}<start_of_turn>{{ m.role }}
{{ m.content }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

PHI3 = r"""{% for message in messages %}
    {% if message['role'] == 'system' %}
{{'<|system|>\n' + message['content'] + '<|end|>\n'}}
    {% elif message['role'] == 'user' %}
{{'<|user|>\n' + message['content'] + '<|end|>\n'}}
    {% elif message['role'] == 'assistant' %}
{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|assistant|>\n' }}
{% else %}
{{ eos_token }}
{% endif %}"""

FEATURES = r"""{%- set ns = namespace(last_user=-1, n=0) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- set meta = dict(model='tiny', turns=messages|length) %}
<|im_start|>meta {{ meta | tojson(sort_keys=true) }} {{ {'q': '<b>"é"</b>'} | tojson }}<|im_end|>
{% for m in messages %}
    {%- if m.role == 'tool' %}{% continue %}{% endif %}
    {%- if loop.index0 > 6 %}{% break %}{% endif %}
    {%- if m.role == 'assistant' %}
<|im_start|>assistant
{% if m.reasoning_content is defined and enable_thinking | default(true) %}<think>{{ m.reasoning_content }}</think>
{% endif %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}
    {%- else %}
<|im_start|>{{ m.role }}{% if loop.index0 == ns.last_user %} (last){% endif %}
{{ m.content }}{% if m.name is defined %} [{{ m.name }}]{% endif %}<|im_end|>
    {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one line."},
    {"role": "user", "content": "What is a list?  "},
    {"role": "assistant", "content": " A mutable sequence. "},
    {"role": "user", "content": "And a tuple? Réponds en français, s'il te plaît 😀"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & here",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
        "name": "get_weather",
    }
]

STYLES = {
    # name: (specials for the tokenizer, how the template is stored, tokenizer_config extras, special_tokens_map)
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "jinja", {"eos_token": "<|im_end|>"}, None),
    "llama3": (
        ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
        "config",
        {
            "bos_token": {
                "__type": "AddedToken",
                "content": "<|begin_of_text|>",
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
            },
            "eos_token": "<|eot_id|>",
        },
        None,
    ),
    "llama2": (["<unk>", "<s>", "</s>"], "config", {}, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "gemma": (
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "list",
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        None,
    ),
    "phi3": (
        ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "config",
        {"eos_token": "<|end|>"},
        None,
    ),
    "features": (["<|im_start|>", "<|im_end|>"], "jinja", {"eos_token": "<|im_end|>", "image_token": "<img>"}, None),
}
TEMPLATES = {"qwen2": QWEN2, "llama3": LLAMA3, "llama2": LLAMA2, "gemma": GEMMA, "phi3": PHI3, "features": FEATURES}


def write_style(d: Path, name: str) -> Path:
    specials, where, extras, stm = STYLES[name]
    d.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    if name == "llama3":  # its tokenizer adds a BOS by itself: the chat prompt must not get a second one
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
        )
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "backend": "tokenizers", **extras}
    template = TEMPLATES[name]
    if where == "jinja":
        (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif where == "config":
        config["chat_template"] = template
    else:
        config["chat_template"] = [
            {"name": "default", "template": template},
            {"name": "tool_use", "template": GEMMA_TOOLS},
        ]
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if stm is not None:
        (d / "special_tokens_map.json").write_text(json.dumps(stm), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def styles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {name: write_style(root / name, name) for name in STYLES}


def conversations(name: str) -> list[tuple[list[dict], dict]]:
    convs = [(CONVERSATION, {}), (CONVERSATION[1:2], {})]
    if name in ("qwen2", "llama3", "gemma"):
        convs.append((CONVERSATION, {"tools": TOOLS}))
    if name == "qwen2":
        call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
        convs.append(([*CONVERSATION[:2], {"role": "assistant", "content": None, "tool_calls": [call]}], {}))
    if name == "features":
        extra = [
            {"role": "assistant", "content": "Une liste.", "reasoning": "think in French", "name": None},
            {"role": "tool", "content": "ignored"},
            {"role": "user", "content": "Merci", "name": "bob"},
        ]
        convs.append(([*CONVERSATION, *extra], {}))
        convs.append(([*CONVERSATION, *extra], {"enable_thinking": False}))
    return convs


@pytest.mark.parametrize("name", list(STYLES))
def test_render_equals_transformers(styles, name):
    d = styles[name]
    hf = AutoTokenizer.from_pretrained(d)
    ours = ChatTemplate.from_artifact(d)
    assert ours is not None
    tok = Tokenizer(d / "tokenizer.json")
    for messages, kwargs in conversations(name):
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
            got = ours.render(messages, add_generation_prompt=gen, **kwargs)
            assert got == want, f"{name} gen={gen} {kwargs}:\n{got!r}\n!=\n{want!r}"
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)["input_ids"]
        text = ours.render(messages, add_generation_prompt=True, **kwargs)
        assert tok.encode(text, add_special_tokens=False) == list(ids), name


def test_special_tokens_as_transformers_reads_them(styles):
    assert ChatTemplate.from_artifact(styles["llama3"]).special_tokens == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    }
    assert ChatTemplate.from_artifact(styles["llama2"]).special_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    feats = ChatTemplate.from_artifact(styles["features"]).special_tokens
    assert feats == {"eos_token": "<|im_end|>", "image_token": "<img>"}
    assert AutoTokenizer.from_pretrained(styles["features"]).special_tokens_map == feats
    # llama3's tokenizer adds its own BOS: encoding the chat prompt with special tokens would double it.
    tok = Tokenizer(styles["llama3"] / "tokenizer.json")
    text = ChatTemplate.from_artifact(styles["llama3"]).render(CONVERSATION)
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.encode(text)[:2] == [bos, bos] and tok.encode(text, add_special_tokens=False)[:2] != [bos, bos]


def test_gemma_list_form_picks_tool_use_with_tools(styles):
    t = ChatTemplate.from_artifact(styles["gemma"])
    assert set(t.templates) == {"default", "tool_use"}
    assert "<start_of_turn>tools\nget_weather;" in t.render(CONVERSATION, tools=TOOLS)
    assert "tools" not in t.render(CONVERSATION)


def test_no_template_is_a_clear_error(tmp_path):
    d = write_style(tmp_path / "plain", "qwen2")
    (d / "chat_template.jinja").unlink()
    assert ChatTemplate.from_artifact(d) is None
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.require(d)
    msg = str(e.value)
    assert "has no chat template" in msg and "generate() with a plain prompt" in msg
    with pytest.raises(ValueError, match="chat_template is not set"):  # transformers refuses too
        AutoTokenizer.from_pretrained(d).apply_chat_template(CONVERSATION, tokenize=False)


@pytest.mark.parametrize("name", ["llama2", "gemma"])
def test_raise_exception_becomes_chat_template_error(styles, name):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    message = "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(jinja2.exceptions.TemplateError, match=message.replace(".", r"\.")):
        AutoTokenizer.from_pretrained(styles[name]).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.from_artifact(styles[name]).render(bad)
    assert message in str(e.value)


def test_sandbox_refusals_and_bad_input():
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="access to attribute"):
        ChatTemplate("{{ messages.__class__.__subclasses__() }}").render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="messages is empty"):
        ChatTemplate("x").render([])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be a dict"):
        ChatTemplate("x").render([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        ChatTemplate({"tool_use": "x"})


def test_messages_are_not_modified(styles):
    messages = [dict(m) for m in CONVERSATION] + [{"role": "assistant", "content": "ok", "reasoning": "r"}]
    before = json.dumps(messages)
    text = ChatTemplate.from_artifact(styles["features"]).render(messages)
    assert json.dumps(messages) == before
    assert "<think>r</think>\nok<|im_end|>" in text  # "reasoning" reached the template as reasoning_content


def test_special_tokens_map_json_precedence_as_transformers(tmp_path):
    """special_tokens_map.json (AddedToken dicts too) overrides tokenizer_config.json, unless the config
    has an added_tokens_decoder (then transformers ignores the file)."""
    legacy = write_style(tmp_path / "legacy", "llama2")
    cfg = json.loads((legacy / "tokenizer_config.json").read_text())
    (legacy / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": "<unk>"}))
    added = {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    stm = {"bos_token": added, "eos_token": "</s>", "pad_token": "</s>"}
    (legacy / "special_tokens_map.json").write_text(json.dumps(stm))
    modern = write_style(tmp_path / "modern", "llama2")
    decoder = {"1": {**added, "special": True}}
    (modern / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "eos_token": "</s>", "added_tokens_decoder": decoder})
    )
    for d, want in (
        (legacy, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}),
        (modern, {"eos_token": "</s>"}),
    ):
        assert (
            ChatTemplate.from_artifact(d).special_tokens == AutoTokenizer.from_pretrained(d).special_tokens_map == want
        )
    want = AutoTokenizer.from_pretrained(legacy).apply_chat_template(CONVERSATION, tokenize=False)
    assert ChatTemplate.from_artifact(legacy).render(CONVERSATION, add_generation_prompt=False) == want
    with pytest.raises(ChatTemplateError, match="'bos_token' is undefined"):  # transformers: UndefinedError
        ChatTemplate.from_artifact(modern).render(CONVERSATION)
