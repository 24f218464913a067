"""kvforge demo's own code path, on the tiny test model: both sides printed, tokens identical, and no
third-party progress bar among its lines."""

from __future__ import annotations

from kvforge.tools.cli import main


def test_demo_compares_kvforge_with_transformers(llama_dir, tmp_path, capsys):
    prompts = ["The for statement", "A list is"]
    argv = ["demo", "--model", str(llama_dir), "--out", str(tmp_path / "art"), "--max-new-tokens", "12"]
    assert main([*argv, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    out = capsys.readouterr()
    for prompt in prompts:
        assert f"prompt: {prompt!r}" in out.out
    assert out.out.count("greedy tokens identical: yes (12 vs 12 tokens); in a ragged batch of 2: same") == 2
    assert "kvforge is" in out.out and "all tokens identical: yes" in out.out
    assert "== 1/3 compile" in out.err and "[kvforge] [7/7" in out.err  # progress while it works
    assert (tmp_path / "art" / "manifest.json").is_file()
    # a quiet run: no third-party progress bar inside kvforge's output (transformers' "Loading weights")
    for stream in (out.out, out.err):
        assert "Loading weights" not in stream and "it/s]" not in stream and "\r" not in stream
