"""Chat templates: a conversation (list of messages) in, the prompt text the model was trained on out.

Input: the artifact's ``chat_template.jinja`` (or ``tokenizer_config.json``'s ``"chat_template"``) and
its special tokens (``tokenizer_config.json``, ``special_tokens_map.json``). Output: the rendered
prompt, exactly what transformers' ``tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=...)`` returns. Encode it with ``Tokenizer.encode(text, add_special_tokens=False)``
to get ``apply_chat_template(tokenize=True)``'s ids.

The jinja2 environment is transformers' (``utils/chat_template_utils.py``): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and a ``{% generation %}`` tag (rendered as its body), a ``tojson`` filter that does not
escape HTML, the globals ``raise_exception``, ``strftime_now``, a limited ``dict`` and a ``namespace``
that refuses underscore-prefixed attributes. Messages are copied to plain JSON data, keys whose value
is None dropped, and reasoning fields aliased, as transformers does before rendering.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes by name.
SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning is passed under (transformers' _REASONING_FIELDS); the first is the standard one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The artifact has no usable chat template, or the template refused the conversation."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers tracks assistant spans with it; rendering
    is the body unchanged (we never ask for the assistant mask)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """A ``dict`` global that only builds dicts (no attribute access to the type)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing underscore-prefixed names (as transformers' TemplateNamespace)."""

    def __init__(*args, **kwargs):  # jinja2 Namespace signature trick: self may be a keyword
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Plain JSON-like copy of ``value`` (transformers' ``_plain_template_data``): what the sandbox may see."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(messages: Sequence[Mapping]) -> list[dict]:
    """transformers' message preparation: dicts only, None-valued keys dropped, reasoning fields aliased."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of dicts like {{'role': 'user', 'content': '...'}}, got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise ChatTemplateError("messages is empty; give at least one message like {'role': 'user', 'content': '...'}")
    out = []
    for i, m in enumerate(messages):
        if dataclasses.is_dataclass(m) and not isinstance(m, type):
            m = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        elif callable(getattr(m, "model_dump", None)):
            m = m.model_dump()
        if not isinstance(m, Mapping):
            raise ChatTemplateError(
                f"messages[{i}] must be a dict like {{'role': 'user', 'content': '...'}}, got {m!r}"
            )
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _token_str(value: Any) -> str | None:
    """A special token as transformers stores it: a string, or an AddedToken dict's ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid JSON ({e}); fix or delete it") from e
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _special_tokens(artifact_dir: Path, config: dict) -> dict[str, str]:
    """The named special tokens transformers' ``special_tokens_map`` gives the template.

    ``tokenizer_config.json``'s ``*_token`` entries (the standard names and model-specific ones such as
    ``image_token``, plus a dict ``extra_special_tokens``); ``special_tokens_map.json`` overrides them only
    when the config has no ``added_tokens_decoder`` (transformers' legacy path).
    """
    values: dict[str, Any] = {k: v for k, v in config.items() if k.endswith("_token")}
    if isinstance(config.get("extra_special_tokens"), Mapping):
        values.update(config["extra_special_tokens"])
    stm = artifact_dir / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and stm.is_file():
        for k, v in _read_json(stm).items():
            if k in SPECIAL_TOKENS_ATTRIBUTES or (k.endswith("_token") and _token_str(v) is not None):
                values[k] = v
            elif k == "extra_special_tokens" and isinstance(v, Mapping):
                values.update(v)
    return {k: s for k, v in values.items() if (s := _token_str(v)) is not None}


class ChatTemplate:
    """A compiled chat template (or several named ones) and the special tokens it is rendered with."""

    def __init__(self, source: str | Mapping[str, str], special_tokens: Mapping[str, str] | None = None) -> None:
        """``source``: the template text, or named templates (``"default"``, optionally ``"tool_use"``, ...)."""
        templates = {"default": source} if isinstance(source, str) else dict(source)
        if "default" not in templates:
            raise ChatTemplateError(
                f"several chat templates ({', '.join(sorted(map(str, templates)))}) and none named 'default'; "
                "name one 'default'"
            )
        self.templates: dict[str, str] = templates
        self.source: str = templates["default"]
        self.special_tokens = dict(special_tokens or {})
        try:
            self._compiled = {name: _compile(text) for name, text in templates.items()}
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e

    @classmethod
    def from_artifact(cls, artifact_dir: Path) -> ChatTemplate | None:
        """The artifact's template, or None when it has none.

        As transformers loads them: ``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``) win
        over ``tokenizer_config.json``'s ``"chat_template"``, which is a string or a list of
        ``{"name", "template"}``. With several, ``render`` uses ``"tool_use"`` when given tools and it exists,
        else ``"default"``.
        """
        artifact_dir = Path(artifact_dir)
        cfg_path = artifact_dir / "tokenizer_config.json"
        config = _read_json(cfg_path) if cfg_path.is_file() else {}
        files = {}
        if (artifact_dir / "chat_template.jinja").is_file():
            files["default"] = (artifact_dir / "chat_template.jinja").read_text(encoding="utf-8")
        extra = artifact_dir / "additional_chat_templates"
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
        if files:
            source: Any = files["default"] if list(files) == ["default"] else files
        else:
            source = config.get("chat_template")
            if isinstance(source, (list, tuple)):
                try:
                    source = {t["name"]: t["template"] for t in source}
                except (TypeError, KeyError) as e:
                    raise ChatTemplateError(
                        f"{cfg_path}: a list chat_template must hold {{'name': ..., 'template': ...}} entries"
                    ) from e
        if source is None:
            return None
        if not isinstance(source, (str, Mapping)) or (
            isinstance(source, Mapping) and not all(isinstance(v, str) for v in source.values())
        ):
            raise ChatTemplateError(f"{cfg_path}: chat_template must be a string, got {type(source).__name__}")
        return cls(source, _special_tokens(artifact_dir, config))

    @staticmethod
    def require(artifact_dir: Path) -> ChatTemplate:
        """``from_artifact``, but a missing template is a ChatTemplateError that says what to do."""
        t = ChatTemplate.from_artifact(artifact_dir)
        if t is None:
            raise ChatTemplateError(
                f"the model in {artifact_dir} has no chat template (no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json), so chat() cannot format messages; use generate() "
                "with a plain prompt instead, or add a chat_template.jinja to the artifact"
            )
        return t

    def render(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
        documents: Sequence[dict] | None = None,
        **kwargs,
    ) -> str:
        """Exactly transformers' ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``.

        ``tools`` (JSON schemas) and ``documents`` are passed as transformers passes them; other keyword
        arguments reach the template as variables (e.g. ``enable_thinking=False``) and override the special
        tokens of the same name. A template that refuses the conversation (``raise_exception``) raises
        ChatTemplateError with the template's message.
        """
        chat = _messages(messages)
        if tools is not None:
            for t in tools:
                if not isinstance(t, Mapping):
                    raise ChatTemplateError(f"tools must be JSON schemas (dicts), got {t!r}")
        if documents is not None:
            for d in documents:
                if not isinstance(d, Mapping):
                    raise ChatTemplateError("documents must be a list of dicts with 'title' and 'text' keys")
        variables = _plain({**self.special_tokens, **kwargs})
        template = self._compiled["tool_use" if tools is not None and "tool_use" in self._compiled else "default"]
        try:
            return template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template raised an error for these messages: {e.message or e}") from e
