"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: the served tokenizer, as
vLLM's server offers it (lm-evaluation-harness' ``local-completions`` finds these and then
tokenizes through the server: ``tokenizer_backend="remote"``).

``/tokenize`` takes ``{"prompt": text}`` (``add_special_tokens`` default true: the tokenizer's BOS
and the like are added, as ``/v1/completions`` encodes a text prompt) or ``{"messages": [...]}``
rendered through the chat template as ``/v1/chat/completions`` renders them
(``add_generation_prompt`` default true, ``add_special_tokens`` default false: the template writes
its own), and answers ``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` when
``return_token_strs``). ``/detokenize`` turns ``{"tokens"}`` into ``{"prompt"}`` (special tokens
kept, as vLLM does). ``/tokenizer_info`` gives the tokenizer's class, its named special tokens
(``eos_token``, ``bos_token``, ...), ``chat_template`` and ``model_max_length`` (the artifact's
max_seq). ``model``, when sent, must be the served name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvforge.runtime.chat import ChatTemplateError
from kvforge.tools.serve import protocol as p
from kvforge.tools.serve.chat import _content
from kvforge.tools.serve.serving import ModelServer, ServingError

TEXT_MESSAGE = "send 'prompt' (text) or 'messages' (a chat), not both"


def _rendered(server: ModelServer, req: p.TokenizeRequest) -> str:
    if server.chat_template is None:
        raise ServingError(
            f"model {server.model_name!r} has no chat template, so 'messages' cannot be rendered; send 'prompt'",
            param="messages",
            code="no_chat_template",
        )
    if not req.messages:
        raise ServingError("messages is empty; send at least one message", param="messages")
    if req.continue_final_message and req.add_generation_prompt:
        raise ServingError(
            "continue_final_message and add_generation_prompt cannot both be true: the first leaves the last message "
            "open, the second starts a new one; set add_generation_prompt to false",
            param="continue_final_message",
        )
    messages = [{"role": m.role, "content": _content(m, i)} for i, m in enumerate(req.messages)]
    try:
        text = server.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt)
    except ChatTemplateError as e:
        raise ServingError(f"the chat template rejected the messages: {e}", param="messages") from e
    if req.continue_final_message:  # as transformers: cut after the last message's content
        last = messages[-1]["content"]
        at = text.rfind(last) if last else -1
        if at < 0:
            raise ServingError(
                "continue_final_message: the rendered chat does not contain the last message's text (the template "
                "rewrites it); send add_generation_prompt instead",
                param="continue_final_message",
            )
        text = text[: at + len(last)]
    return text


def tokenize(server: ModelServer, req: p.TokenizeRequest) -> p.TokenizeResponse:
    if req.model is not None:
        server.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ServingError(f"the request has {'both' if req.prompt is not None else 'neither'}: {TEXT_MESSAGE}")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = server.encode(req.prompt, special=special)
    else:
        special = bool(req.add_special_tokens)
        ids = server.encode(_rendered(server, req), special=special)
    strs = [server.token_text(t) for t in ids] if req.return_token_strs else None
    return p.TokenizeResponse(count=len(ids), max_model_len=server.max_seq, tokens=ids, token_strs=strs)


def detokenize(server: ModelServer, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
    if req.model is not None:
        server.check_model(req.model)
    vocab = server.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ServingError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return p.DetokenizeResponse(prompt=server.tokenizer.decode(req.tokens, skip_special_tokens=False))


def tokenizer_info(server: ModelServer) -> dict[str, Any]:
    """vLLM's tokenizer info: the tokenizer config's class and named special tokens (``eos_token``
    from the artifact's eos id when the config names none: lm-eval reads its id from it), the chat
    template (None without one) and ``model_max_length`` (max_seq)."""
    path = Path(server.engine.artifact_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    info: dict[str, Any] = {"tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast")}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        info[name] = value.get("content") if isinstance(value, dict) else value
    eos_ids = sorted(getattr(server.engine, "eos_token_ids", ()))
    if info["eos_token"] is None and eos_ids:  # no tokenizer config: the generation config's eos id
        info["eos_token"] = server.token_text(eos_ids[0])
    for name in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
        if name in config:
            info[name] = config[name]
    info["chat_template"] = server.chat_template.source if server.chat_template is not None else None
    info["model_max_length"] = server.max_seq
    return info
