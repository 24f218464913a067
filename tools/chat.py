"""``kvforge chat``: an interactive multi-turn chat on one session of the engine.

Each line read is a user turn. The whole conversation is rendered with the model's chat template
and the session syncs to it (``Session.sync``: the cached common prefix stays, only the new tokens
are prefilled), then the reply streams to ``out`` and joins the conversation. ``/exit`` or end of
input ends the chat; an empty line is skipped. The ``> `` prompt goes to ``err``, and only when
``inp`` is a terminal, so piped output holds the replies alone (one per line after its text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from kvforge.runtime import Engine, SamplingParams


def chat_loop(
    engine: Engine,
    inp: TextIO,
    out: TextIO,
    err: TextIO,
    system: str | None = None,
    max_new_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] | None = None,
) -> int:
    """Run the chat until ``/exit`` or end of input; returns the number of turns answered."""
    messages = [{"role": "system", "content": system}] if system else []
    interactive = inp.isatty()
    turns = 0
    with engine.session() as session:
        while True:
            if interactive:
                err.write("> ")
                err.flush()
            line = inp.readline()
            if not line or line.strip() == "/exit":
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            messages.append({"role": "user", "content": text})
            session.sync(engine.chat_prompt(messages))
            parts = []
            for chunk in session.stream(max_new_tokens, sampling, stop):
                out.write(chunk.text)
                out.flush()
                parts.append(chunk.text)
            out.write("\n")
            out.flush()
            messages.append({"role": "assistant", "content": "".join(parts)})
            turns += 1
    return turns
