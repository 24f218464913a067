"""The kvforge CLI end to end: compile and generate through main(), and one-line errors with exit 2."""

from __future__ import annotations

import json

from kvforge.runtime import Engine
from kvforge.tools.cli import main


def test_compile_then_generate(llama_dir, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compile", str(llama_dir), "-o", str(out), "--max-batch", "2", "--max-seq", "64"]) == 0
    captured = capsys.readouterr()
    assert "compiled LlamaForCausalLM" in captured.out and "greedy match True" in captured.out
    assert "[kvforge] [1/7" in captured.err and "exporting decode graph" in captured.err  # progress
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["limits"]["max_batch"] == 2 and manifest["limits"]["max_seq"] == 64

    assert main(["generate", str(out), "The for statement", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out.strip()
    with Engine.load(out) as engine:
        [expected] = engine.generate(["The for statement"], max_new_tokens=6)
    assert printed == "The for statement" + expected.text


def test_errors_are_one_line_with_exit_2(tmp_path, capsys):
    assert main(["compile", str(tmp_path / "missing"), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error: model directory") and "does not exist" in err
    assert "Traceback" not in err

    assert main(["generate", str(tmp_path), "hi"]) == 2
    assert "not a kvforge artifact" in capsys.readouterr().err
