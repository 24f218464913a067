"""``kvforge generate`` streams prompt + continuation equal to Engine.generate, with the sampling
flags (a seed reproduces SamplingParams' tokens) and repeatable --stop; bad flags are one-line
errors (exit 2). ``kvforge chat`` run as a subprocess with turns on stdin answers each turn as
Engine.chat on the conversation so far, ends at /exit or EOF, and a model without a chat template
is a one-line error with exit 2."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from kvforge.runtime import Engine, SamplingParams
from kvforge.tools.chat import chat_loop
from kvforge.tools.cli import main


@pytest.fixture(scope="module")
def engine(llama_artifact):
    with Engine.load(llama_artifact) as engine:
        yield engine


def test_generate_streams_the_greedy_continuation(llama_artifact, engine, capsys):
    assert main(["generate", str(llama_artifact), "The for statement", "--max-new-tokens", "8"]) == 0
    [expected] = engine.generate(["The for statement"], max_new_tokens=8)
    assert capsys.readouterr().out == "The for statement" + expected.text + "\n"


def test_generate_takes_the_sampling_flags(llama_artifact, engine, capsys):
    flags = ["--temperature", "0.9", "--top-k", "30", "--top-p", "0.95", "--min-p", "0.01"]
    flags += ["--repetition-penalty", "1.1", "--presence-penalty", "0.5", "--frequency-penalty", "0.2", "--seed", "5"]
    assert main(["generate", str(llama_artifact), "The while loop", "--max-new-tokens", "12", *flags]) == 0
    params = SamplingParams(
        temperature=0.9,
        top_k=30,
        top_p=0.95,
        min_p=0.01,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        seed=5,
    )
    [expected] = engine.generate(["The while loop"], max_new_tokens=12, sampling=params)
    assert capsys.readouterr().out == "The while loop" + expected.text + "\n"


def test_generate_stops_at_a_stop_string(llama_artifact, engine, capsys):
    [free] = engine.generate(["The for statement"], max_new_tokens=16)
    stop = next(ch for ch in free.text[3:] if ch.strip() and ch != "\ufffd")
    argv = ["generate", str(llama_artifact), "The for statement", "--max-new-tokens", "16"]
    assert main([*argv, "--stop", "never-there", "--stop", stop]) == 0
    [expected] = engine.generate(["The for statement"], max_new_tokens=16, stop=["never-there", stop])
    assert expected.finish_reason == "stop" and expected.stop_string == stop
    assert capsys.readouterr().out == "The for statement" + expected.text + "\n"


def test_several_prompts_print_one_block_each(llama_artifact, engine, capsys):
    assert main(["generate", str(llama_artifact), "The for", "A list", "--max-new-tokens", "4"]) == 0
    results = engine.generate(["The for", "A list"], max_new_tokens=4)
    out = capsys.readouterr().out
    for prompt, r in zip(["The for", "A list"], results):
        assert f"--- {prompt!r} ({r.finish_reason})\n{prompt}{r.text}\n" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--stop", ""], "stop"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_bad_generate_flags_are_one_line_errors(llama_artifact, capsys, flags, message):
    assert main(["generate", str(llama_artifact), "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error: ") and message in err and err.count("\n") == 1


def _chat(artifact, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvforge.tools.cli", "chat", str(artifact), "--max-new-tokens", "6", *flags]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)


def test_chat_answers_each_turn_like_engine_chat(llama_chat_artifact):
    turns = "The for statement?\n\nAnd the while loop?\n/exit\nnever read\n"  # an empty line is skipped
    done = _chat(llama_chat_artifact, turns, "--system", "Hi")
    assert done.returncode == 0, done.stderr
    messages = [{"role": "system", "content": "Hi"}]
    expected = []
    with Engine.load(llama_chat_artifact) as engine:
        for question in ("The for statement?", "And the while loop?"):
            messages.append({"role": "user", "content": question})
            reply = engine.chat(messages, max_new_tokens=6).text
            messages.append({"role": "assistant", "content": reply})
            expected.append(reply)
    assert done.stdout == "".join(f"{r}\n" for r in expected)
    assert done.stderr == ""  # no prompt when stdin is not a terminal


def test_chat_ends_at_end_of_input(llama_chat_artifact):
    inp, out, err = io.StringIO("The for statement?\nAnd?"), io.StringIO(), io.StringIO()  # no newline, then EOF
    with Engine.load(llama_chat_artifact) as engine:
        assert chat_loop(engine, inp, out, err, max_new_tokens=4) == 2
        assert engine.general_rows() == engine.max_batch  # the chat's session gave its row back
    assert out.getvalue().count("\n") == 2 and err.getvalue() == ""


def test_chat_without_a_template_is_a_one_line_error(llama_artifact, capsys):
    assert main(["chat", str(llama_artifact)]) == 2  # before reading stdin
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("kvforge: error: ")
    assert "has no chat template" in captured.err and captured.err.count("\n") == 1
