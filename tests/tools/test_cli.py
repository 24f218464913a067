"""The kvforge CLI end to end: compile and generate through main(), and one-line errors with exit 2."""

from __future__ import annotations

import json
import re

import pytest

from kvforge.runtime import Engine
from kvforge.tools.cli import main


def test_compile_then_generate(llama_dir, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compile", str(llama_dir), "-o", str(out), "--max-batch", "2", "--max-seq", "64"]) == 0
    captured = capsys.readouterr()
    assert "compiled LlamaForCausalLM" in captured.out and "greedy match True" in captured.out
    assert "[kvforge] [1/7" in captured.err and "exporting the model once" in captured.err  # progress
    # Every stage reports its time when it ends: "[i/7   t s] <stage> took x s".
    took = re.findall(r"\[kvforge\] \[(\d)/7 +[\d.]+s\] (\w+) took ([\d.]+)s", captured.err)
    stages = ["load", "reference", "export", "write", "optimize", "parity", "manifest"]
    assert [(int(i), name) for i, name, _ in took] == list(enumerate(stages, 1)), captured.err
    assert re.search(r"export took [\d.]+s \(trace and ONNX translation [\d.]+s, onnxscript optimizer", captured.err)
    assert "; traced all 2 layers: 2 layers, no more than a prefix of 3)" in captured.err  # how the stack was traced
    assert re.search(r"optimize took [\d.]+s \(onnxscript fusions [\d.]+s, ORT offline optimizer", captured.err)
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


def test_full_trace_is_a_hidden_compile_option(tmp_path, capsys):
    """--full-trace (trace every layer, never copy one: for debugging) parses, and help omits it."""
    assert main(["compile", str(tmp_path / "missing"), "-o", str(tmp_path / "o"), "--full-trace"]) == 2
    assert "does not exist" in capsys.readouterr().err  # parsed: the model directory was checked
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    help_text = capsys.readouterr().out
    assert "--trust-remote-code" in help_text and "--full-trace" not in help_text


# ---------------------------------------------------------------- GPU commands on a machine without a GPU


def _no_gpu_here() -> str | None:
    from kvforge.graphs import environment

    return environment.build_refusal(environment.cuda_gpu(), environment.tensorrt_module())


def test_compile_target_tensorrt_then_plan_and_build(llama_dir, tmp_path, capsys):
    import pytest

    if _no_gpu_here() is None:
        pytest.skip("this machine can build TensorRT engines: the refusal cannot be seen here")
    out = tmp_path / "trt"
    args = ["compile", str(llama_dir), "-o", str(out), "--target", "tensorrt", "--max-batch", "2"]
    assert main([*args, "--max-seq", "64", "--max-prompt", "48", "-q"]) == 0
    printed = capsys.readouterr().out
    assert "TensorRT engines not built here: run `kvforge build OUT` on the target GPU" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["target"], manifest["lowering"], manifest["dtype"]) == ("tensorrt", "onnx", "float16")
    assert manifest["limits"] == {"max_batch": 2, "max_seq": 64, "max_prompt": 48}
    assert manifest["engines"] == {} and not (out / "prefill.ort.onnx").exists()

    # build: one line naming what is missing and what to run, exit 2.
    assert main(["build", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvforge: error: cannot build TensorRT engines here: ")
    assert err.rstrip().endswith("; run `kvforge build OUT` on the target GPU")
    assert "cuda-python is not installed" in err or "CUDA" in err

    # plan: the table for the artifact's own limits, and the JSON.
    assert main(["plan", str(out), "--gpu-memory", "1GiB"]) == 0
    table = capsys.readouterr().out
    assert "memory plan for" in table and "float16, max_batch 2, max_seq 64, max_prompt 48" in table
    assert "budget 1.00 GiB (--gpu-memory): fits" in table
    assert main(["plan", str(out), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_cache_bytes"] == manifest["kv_cache"]["bytes"] and plan["fits"] is None
    tight = plan["total_bytes"] - plan["kv_cache_bytes"] // 2  # half the cache does not fit
    assert main(["plan", str(out), "--json", "--gpu-memory", str(tight)]) == 1  # does not fit: exit 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["advice"].startswith("does not fit: lower --max-seq ")


def test_build_refuses_a_gqa_artifact(llama_artifact, capsys):
    assert main(["build", str(llama_artifact)]) == 2
    err = capsys.readouterr().err
    assert "uses the gqa lowering, which TensorRT cannot parse; recompile with" in err and "--target tensorrt" in err


def test_plan_of_a_model_dir_without_a_gpu(llama_dir, capsys):
    assert main(["plan", str(llama_dir), "--max-batch", "8", "--max-seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "float16, max_batch 8, max_seq 1024, max_prompt 1024" in out
    if _no_gpu_here():
        assert "give --gpu-memory 70GiB to check a fit" in out
    assert main(["plan", str(llama_dir), "--gpu-memory", "lots"]) == 2
    assert "cannot read 'lots' as a memory size" in capsys.readouterr().err


def test_plan_exits_1_when_it_does_not_fit_and_never_suggests_the_dtype_in_use(llama_dir, capsys):
    assert main(["plan", str(llama_dir), "--gpu-memory", "1GiB"]) == 0  # the tiny model fits
    assert "budget 1.00 GiB (--gpu-memory): fits" in capsys.readouterr().out
    # 1 MiB: not even the CUDA reserve fits. float16 (the default) is the smallest dtype already.
    assert main(["plan", str(llama_dir), "--gpu-memory", "1MiB"]) == 1
    table = capsys.readouterr().out
    assert "DOES NOT FIT" in table and "use a smaller or quantized model, or a GPU with more memory" in table
    assert "--dtype" not in table
    assert main(["plan", str(llama_dir), "--gpu-memory", "1MiB", "--dtype", "float32", "--json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and "use --dtype float16, a smaller or quantized model" in plan["advice"]


def test_compile_target_cuda_records_optimization_at_load(llama_dir, tmp_path, capsys):
    out = tmp_path / "cuda"
    assert main(["compile", str(llama_dir), "-o", str(out), "--target", "cuda", "--max-seq", "32", "-q"]) == 0
    capsys.readouterr()
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["target"], manifest["lowering"], manifest["dtype"]) == ("cuda", "gqa", "float16")
    assert manifest["ort_optimization"]["optimized_for"] == "CUDAExecutionProvider"
    assert manifest["ort_optimization"]["offline"] is False
    assert "needs the CUDA provider itself" in manifest["ort_optimization"]["why"]
    assert manifest["limits"]["max_prompt"] == 32
    bad = ["compile", str(llama_dir), "-o", str(tmp_path / "x"), "--target", "tensorrt", "--lowering", "gqa"]
    assert main(bad) == 2
    assert "--target tensorrt needs the onnx lowering" in capsys.readouterr().err


def test_compare_and_bench_pass_the_device_through(llama_artifact, llama_dir, capsys):
    if _no_gpu_here() is None:
        import pytest

        pytest.skip("this machine has a GPU")
    for cmd in (["compare", str(llama_artifact), "--reference", str(llama_dir)], ["bench", str(llama_artifact)]):
        assert main([*cmd, "--device", "cuda", "--backend", "tensorrt"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvforge: error: device='cuda' needs CUDA: ") and err.count("\n") == 1
