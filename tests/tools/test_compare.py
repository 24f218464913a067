"""``kvforge compare`` on the tiny Llama: an exact fp32 artifact passes with the documented JSON
(checked against transformers computed here), strided perplexity windows (--stride) agree too, a
weight-perturbed copy is flagged, bad inputs are one-line errors; and the logit metrics match
their definitions."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import onnx
import pytest
import torch

from kvforge.runtime import Engine
from kvforge.tools import compare, metrics
from kvforge.tools.cli import main
from tests.helpers import hf_greedy

STEPS = 4
SECTION_KEYS = {"positions", "max_abs_diff", "mean_abs_diff", "kl_mean", "kl_max", "top1_agreement", "top5_agreement"}


@pytest.fixture(scope="module")
def exact_report(llama_artifact, llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    argv = ["compare", str(llama_artifact), "--reference", str(llama_dir), "--steps", str(STEPS), "--threads", "1"]
    argv += ["--json", str(out / "c.json"), "--plot", str(out / "c.png")]
    threads = torch.get_num_threads()
    status = main(argv)
    assert torch.get_num_threads() == threads  # --threads 1 held for the run only
    return status, out


def test_bare_compare_passes_with_documented_json(exact_report, capsys):
    status, out = exact_report
    assert status == 0
    result = json.loads((out / "c.json").read_text())
    assert result["kind"] == "kvforge.compare" and result["schema_version"] == 1
    assert set(result) == {
        "kind", "schema_version", "artifact", "reference", "settings", "prefill", "decode",
        "greedy", "perplexity", "batch", "layers", "verdict",
    }  # fmt: skip
    prompts = compare.load_prompts(None)  # the bundled ones: nothing was passed
    assert result["settings"]["prompts"] == prompts and result["settings"]["steps"] == STEPS
    assert result["reference"]["matches_source"] is True
    atol = result["verdict"]["atol"]
    assert atol == compare.DEFAULT_ATOL["float32"]
    for section in ("prefill", "decode", "perplexity"):
        s = result[section]
        assert set(s) >= SECTION_KEYS, section
        assert s["top1_agreement"] == 1.0 and s["top5_agreement"] == 1.0, section
        assert 0.0 <= s["mean_abs_diff"] <= s["max_abs_diff"] < atol, section
        assert 0.0 <= s["kl_mean"] <= s["kl_max"] < 1e-6, section
    assert result["prefill"]["positions"] == len(prompts)
    assert result["decode"]["positions"] == len(prompts) * STEPS
    assert [s["step"] for s in result["decode"]["per_step"]] == list(range(STEPS))
    assert all(len(p["max_abs_diff_per_step"]) == STEPS for p in result["decode"]["per_prompt"])
    layers = result["layers"]  # each layer's keys and values after prompt + continuation, as transformers' cache
    num_layers = result["artifact"]["num_layers"]
    assert [(r["layer"], r["part"]) for r in layers["per_layer"]] == [
        (layer, part) for layer in range(num_layers) for part in ("key", "value")
    ]
    assert 0.0 <= layers["max_abs_diff"] < atol
    assert result["greedy"]["all_identical"] and all(r["diverged_at"] is None for r in result["greedy"]["per_prompt"])
    batch = result["batch"]
    assert batch["batch_size"] == 4 and batch["ragged"] and batch["all_consistent"]
    assert [r["prompt"] for r in batch["rows"]] == list(range(len(prompts)))
    assert result["verdict"] == {"ok": True, "atol": atol, "failures": []}
    assert (out / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_numbers_are_transformers_own(exact_report, llama_artifact, llama_reference):
    """Greedy tokens and perplexity in the JSON are what transformers itself computes."""
    _, out = exact_report
    result = json.loads((out / "c.json").read_text())
    with Engine.load(llama_artifact) as engine:
        rows = [engine.encode(p) for p in result["settings"]["prompts"]]
        text_ids = engine.encode(compare.load_text(None))
        window = engine.max_seq
    for row, got in zip(rows, result["greedy"]["per_prompt"]):
        expected = hf_greedy(llama_reference, row, STEPS)  # stops at eos, as the report's reference tokens do
        assert got["reference_tokens"] == expected and got["kvforge_tokens"] == expected

    total, count = 0.0, 0
    for i in range(0, len(text_ids), window):
        chunk = torch.tensor([text_ids[i : i + window]])
        if chunk.shape[1] < 2:
            continue
        with torch.no_grad():
            loss = llama_reference(chunk, labels=chunk).loss  # mean NLL of tokens 1.. of the window
        total, count = total + float(loss) * (chunk.shape[1] - 1), count + chunk.shape[1] - 1
    ppl = result["perplexity"]
    assert ppl["scored_tokens"] == count and ppl["tokens"] == len(text_ids)
    assert ppl["reference"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert ppl["kvforge"] == pytest.approx(ppl["reference"], rel=1e-5) and ppl["kvforge"] > 1.0


def test_report_prints_table_and_verdict(exact_report):
    result = json.loads((exact_report[1] / "c.json").read_text())
    text = compare.format_report(result)
    for needle in ("prefill (last token)", f"decode ({STEPS} teacher-forced)", "KL(ref|kvf)", "perplexity (", "OK:"):
        assert needle in text
    assert "greedy (4 new tokens, 6 prompts): identical for every prompt" in text
    assert "MISMATCH" not in text


def _perturb_weights(artifact, scale: float = 0.05) -> None:
    """Add noise to the largest float32 tensor of the shared weights file (the manifest's sha256 is left stale)."""
    model = onnx.load(str(artifact / "decode.onnx"), load_external_data=False)
    spans = []
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL and init.data_type == onnx.TensorProto.FLOAT:
            info = {e.key: e.value for e in init.external_data}
            spans.append((int(info["length"]), int(info.get("offset", 0))))
    length, offset = max(spans)
    data = np.memmap(artifact / "weights.data", dtype=np.float32, mode="r+", offset=offset, shape=(length // 4,))
    data += np.random.default_rng(0).normal(0.0, scale, size=data.shape).astype(np.float32)
    data.flush()
    del data


def test_compare_flags_perturbed_weights(llama_artifact, llama_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(llama_artifact, broken)
    _perturb_weights(broken)
    (tmp_path / "prompts.txt").write_text("The for statement\nA list is a mutable sequence\n")
    (tmp_path / "text.txt").write_text("Functions are defined with def and return a value.")
    argv = ["compare", str(broken), "--reference", str(llama_dir), "--steps", "2", "--threads", "1"]
    argv += ["--prompts", str(tmp_path / "prompts.txt"), "--text", str(tmp_path / "text.txt")]

    assert main(argv) == 2  # hashes are checked by default: the modified file is refused
    assert "does not match its sha256" in capsys.readouterr().err

    assert main([*argv, "--no-verify", "--json", str(tmp_path / "c.json")]) == 1
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "c.json").read_text())
    assert not result["verdict"]["ok"] and result["settings"]["verified_hashes"] is False
    atol = result["verdict"]["atol"]
    assert result["prefill"]["max_abs_diff"] > atol and result["decode"]["max_abs_diff"] > atol
    assert result["decode"]["kl_mean"] > 1e-6
    assert "MISMATCH: prefill max|diff|" in printed and "MISMATCH: decode max|diff|" in printed
    assert "OK:" not in printed
    assert result["batch"]["all_consistent"]  # still self-consistent: only the weights are wrong


def test_compare_without_score_graph_skips_perplexity(llama_artifact, llama_dir, tmp_path, capsys):
    """Artifacts compiled with --no-score-graph still compare; only the perplexity is skipped."""
    art = tmp_path / "art"
    shutil.copytree(llama_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    for name in (manifest["graphs"].pop("score")["file"], "score.ort.onnx"):
        (art / name).unlink(missing_ok=True)
    (art / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "prompts.txt").write_text("The for statement\nA list is\n")
    argv = ["compare", str(art), "--reference", str(llama_dir), "--steps", "2", "--threads", "1"]
    assert main([*argv, "--prompts", str(tmp_path / "prompts.txt"), "--json", str(tmp_path / "c.json")]) == 0
    result = json.loads((tmp_path / "c.json").read_text())
    assert "no score graph" in result["perplexity"]["skipped"] and result["verdict"]["ok"]
    assert result["decode"]["top1_agreement"] == 1.0
    assert "perplexity: skipped (the artifact has no score graph" in capsys.readouterr().out


def test_compare_user_errors_are_one_line(llama_artifact, llama_dir, tmp_path, capsys):
    base = ["compare", str(llama_artifact), "--reference", str(llama_dir)]
    assert main([*base, "--steps", "500"]) == 2
    err = capsys.readouterr().err
    assert "max_seq=96" in err and "--steps" in err and "Traceback" not in err

    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main([*base, "--prompts", str(empty)]) == 2
    assert "has no prompts" in capsys.readouterr().err

    assert main([*base, "--text", str(tmp_path / "missing.txt")]) == 2
    assert "--text file" in capsys.readouterr().err

    assert main(["compare", str(llama_artifact), "--reference", str(tmp_path / "nope"), "--steps", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_metrics_follow_their_definitions():
    ref = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    ours = ref.clone()
    ours[0, 6], ours[0, 0] = 0.0, 6.0  # row 0: argmax moves to token 0; its top-5 keeps 4 of the reference's 5
    per = metrics.per_position(ours, ref)
    assert per["max_abs_diff"].tolist() == [6.0, 0.0]
    assert per["top1"].tolist() == [0.0, 1.0]
    assert per["top5"][0].item() == pytest.approx(4 / 5) and per["top5"][1].item() == 1.0
    p, q = torch.softmax(ref[0].double(), -1), torch.softmax(ours[0].double(), -1)
    assert per["kl"][0].item() == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-6)
    assert per["kl"][1].item() == 0.0
    summary = metrics.summarize(per)
    assert summary["positions"] == 2 and summary["top1_agreement"] == 0.5
    assert summary["mean_abs_diff"] == pytest.approx(12.0 / 14)

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(130, 50, generator=generator), torch.randn(130, 50, generator=generator)
    chunked, whole = metrics.per_position(a, b, chunk=64), metrics.per_position(a, b, chunk=1000)
    assert all(torch.allclose(chunked[k], whole[k]) for k in metrics.KEYS)

    nll = metrics.token_nll(ref, torch.tensor([6, 0]))
    assert nll[0].item() == pytest.approx(-float(torch.log_softmax(ref[0], -1)[6]))

    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 1]) == 2  # one side stopped (eos) earlier


def test_compare_strided_perplexity(llama_artifact, llama_dir):
    """--stride: overlapping windows, every token after the first scored once, both sides alike."""
    text = compare.load_text(None)
    result = compare.run_compare(llama_artifact, llama_dir, ["Hello"], text, steps=1, threads=1, stride=40)
    ppl = result["perplexity"]
    assert ppl["stride"] == 40 and ppl["window_tokens"] == 96
    assert ppl["scored_tokens"] == ppl["tokens"] - 1 and ppl["windows"] > 2
    assert ppl["kvforge"] == pytest.approx(ppl["reference"], rel=1e-5)
    assert ", stride 40)" in compare.format_report(result)
    with pytest.raises(ValueError, match="--stride 97 must lie in 1..96"):
        compare.run_compare(llama_artifact, llama_dir, ["Hello"], text, steps=1, stride=97)
