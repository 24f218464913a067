"""llama.cpp (through llama-cpp-python) vs kvforge vs onnxruntime-genai, one run, equal threads.

llama.cpp is what most people run a small LM with on a CPU. This benchmark builds
llama-cpp-python from source in its own cached venv (``--llama-venv``, default
``~/.cache/kvforge/peers/llamacpp-venv``; ``CMAKE_ARGS=-DGGML_NATIVE=ON pip install --no-binary
llama-cpp-python llama-cpp-python==VERSION``: minutes on 2 cores, once; a venv that already
imports that version is reused) and runs every side in a process of its own, the sides taking
turns over ``--rounds`` rounds (benchmarks/peer_genai.py's workers and rounds, imported). Rows
(``--sides``, ``--precisions``), per ``--model`` (one report each, in one run):

* ``llama.cpp``: the GGUF file. ``kvforge (GGUF blocks)``: ``kvforge compile FILE.gguf`` on that
  same file (its Q4_0/Q8_0/Q4_1 blocks kept, compile/gguf_exact.py). ``kvforge (int4|fp32)``:
  compiled from the HF directory. ``onnxruntime-genai (int4|fp32)``: its model builder
  (``python -m onnxruntime_genai.models.builder -p PRECISION -e cpu``) on that directory.
* ``--model smollm2``: SmolLM2-135M-Instruct, the Q4_1 GGUF (``--gguf``) and the HF directory
  converted from it (``--hf-dir``; ``make smollm2``); int4 and fp32. Prompts: ``--batch`` slices
  of ``--prompt-len`` tokens of the quality text (benchmarks/quality.py), the same ids every side.
* ``--model qwen3.5-0.8b`` / ``lfm2-350m`` / ``granite-4.0-h-350m`` (issue 39's hybrids): a random model of
  ``common.MODEL_SHAPES``' shape with SmolLM2's tokenizer and its 49,152-token vocabulary (llama.cpp's
  converter needs a tokenizer it knows; the shapes' own are not on this machine), float32; the
  GGUF side and the rest as ``large`` below (the GGUF-blocks and genai sides do not take these
  families: llamacpp and kvforge rows only), int4 only. Random prompt ids.
* ``--model large``: a random Llama of about 1.39B parameters (Qwen2-1.5B's layout: 28 layers,
  hidden 1536, 12/2 heads, intermediate 8960, tied; SmolLM2's 49,152-token tokenizer, which
  llama.cpp's converter knows), saved in float16; llama.cpp's own converter (the
  ``convert_hf_to_gguf.py`` inside the llama-cpp-python sdist) writes it as an f16 GGUF and
  ``llama_model_quantize`` makes the Q4_0 file (its tied token_embd becomes Q6_K: the GGUF-blocks
  side quantizes that one to int8, ``GGUF_REST``); int4 only. Random prompt ids.

What each side times (wall clock around its own API, as peer_genai.py does), every side with a KV
capacity of ``--max-seq`` tokens a sequence:

* llama.cpp: the low-level API: one ``llama_decode`` of the whole batch (each row its own
  sequence id; ``n_seq_max = batch``, ``n_ctx = batch x --max-seq``) + argmax of each row's
  logits is the TTFT; each later step is one ``llama_decode`` of ``batch`` tokens + argmax.
  llama.cpp's defaults otherwise (flash attention auto, f16 KV cache, mmap).
* kvforge: ``Engine.prefill_prompt`` (calls of ``chunk_tokens``, as generation) + argmax, then
  ``Engine.decode`` + argmax per step (the artifact at compile's defaults: max_batch 4, max_seq
  512; only the quantization differs).
* genai: ``append_tokens`` + the first ``generate_next_token``, then one per step; its shared
  KV buffer sized by ``max_length = --max-seq``.

Greedy agreement: leading tokens equal to the reference row's (``--model smollm2``: kvforge fp32,
which matches transformers to ~5e-5 in logits; ``large``: llama.cpp's Q4_0; a hybrid: llama.cpp's
F32 GGUF, which kvforge fp32 equals to the token on the Qwen3.5-0.8B shape).
Perplexity: read from benchmarks/quality.py's JSON (``--quality``), printed next to each row.
`uptime` is printed before and after each model's rounds.

    python benchmarks/peer_llamacpp.py --model smollm2 large --json peers.json
    python benchmarks/peer_llamacpp.py --model large --sides llamacpp kvforge --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_genai as pg
from common import load_text

LLAMA_CPP_VERSION = "0.3.36"
CACHE = Path(os.environ.get("KVFORGE_PEERS_CACHE", Path.home() / ".cache" / "kvforge" / "peers"))
# `make smollm2` puts both here ($KVFORGE_CACHE/smollm2, default ~/.cache/kvforge/smollm2).
# (kvforge.graphs.environment.cache_root's rule, spelled out: this file also runs in the llama.cpp venv,
# which has no kvforge)
SMOLLM2 = Path(os.environ.get("KVFORGE_CACHE") or "~/.cache/kvforge").expanduser() / "smollm2"
SMOLLM2_GGUF = SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HF = SMOLLM2 / "hf"
SIDES = ("llamacpp", "gguf", "kvforge", "genai")
# Qwen2-1.5B's layout as a Llama with SmolLM2's vocabulary: 1.39B parameters.
LARGE = dict(layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=49152, tied=True)
# Issue 39's hybrid shapes (common.MODEL_SHAPES), with SmolLM2's tokenizer and vocabulary.
HYBRIDS = ("qwen3.5-0.8b", "lfm2-350m", "granite-4.0-h-350m")
MODELS = ("smollm2", "large", *HYBRIDS)
# The converter expects Qwen3.5's multi-token-prediction layers, which the random model has none of.
CONVERT_FLAGS = {"qwen3.5-0.8b": ["--no-mtp"]}
SCRIPT = Path(__file__).resolve()


# ---------------------------------------------------------------------------- llama-cpp-python's venv


def build_command(venv: Path, version: str = LLAMA_CPP_VERSION) -> tuple[list[str], dict[str, str]]:
    """The pip command (and its environment) that builds llama-cpp-python from source in ``venv``."""
    cmd = [str(venv / "bin" / "pip"), "install", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={version}"]
    return cmd, {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"}


def installed_version(python: Path) -> str | None:
    if not python.exists():
        return None
    proc = subprocess.run(
        [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def ensure_llama_venv(venv: Path, version: str = LLAMA_CPP_VERSION) -> str:
    """The venv's python, building llama-cpp-python ``version`` there first unless it imports already."""
    python = venv / "bin" / "python"
    have = installed_version(python)
    if have == version:
        return str(python)
    pg.say(f"building llama-cpp-python {version} from source in {venv} (minutes; once)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cmd, env = build_command(venv, version)
    log = venv.parent / "llamacpp-build.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or installed_version(python) != version:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise pg.StepFailed(f"building llama-cpp-python {version} failed (exit {proc.returncode}); log {log}:\n{tail}")
    return str(python)


def llama_cpp_source(version: str = LLAMA_CPP_VERSION) -> Path:
    """The llama-cpp-python sdist, unpacked under the cache: its vendor/llama.cpp holds the converter."""
    root = CACHE / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += [f"llama-cpp-python=={version}", "-d", str(CACHE)]
        pg.run_logged(cmd, CACHE / "sdist-download.log", "pip download llama-cpp-python (sdist)")
        with tarfile.open(CACHE / f"llama_cpp_python-{version}.tar.gz") as tar:
            tar.extractall(CACHE, filter="data")
    return root


# ---------------------------------------------------------------------------- workers (subprocesses)


def _quiet_llama(llama_cpp) -> None:
    """llama.cpp logs every load to stderr; keep errors only."""
    global _LOG_CALLBACK

    @llama_cpp.llama_log_callback
    def callback(level, text, user_data):
        if level == GGML_LOG_LEVEL_ERROR:
            sys.stderr.write(text.decode(errors="replace"))

    _LOG_CALLBACK = callback  # kept alive: llama.cpp holds the pointer
    llama_cpp.llama_log_set(callback, None)


_LOG_CALLBACK = None
GGML_LOG_LEVEL_ERROR = 4  # ggml.h's enum ggml_log_level (vendor/llama.cpp of 0.3.36)


class _Llama:
    """A llama.cpp model and context through the low-level API: ``n_seq_max`` sequences of up to
    ``n_ctx / n_seq_max`` tokens, batches of up to ``n_batch`` tokens."""

    def __init__(self, gguf: str, threads: int, n_ctx: int, n_seq_max: int, n_batch: int, extra_bufts: bool = True):
        import llama_cpp

        self.L = L = llama_cpp
        _quiet_llama(L)
        L.llama_backend_init()
        model_params = L.llama_model_default_params()
        model_params.use_extra_bufts = extra_bufts  # llama.cpp's default: on (repacked weights)
        self.model = L.llama_model_load_from_file(gguf.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        params = L.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx, n_seq_max
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context (n_ctx {n_ctx}, n_seq_max {n_seq_max})")
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_batch, 0, n_seq_max)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.memory, True)

    def decode(self, rows: list[list[int]], start: int, all_logits: bool = False) -> list[int]:
        """One ``llama_decode``: row i's tokens go to sequence i at positions ``start..``; returns the
        batch index of each row's last token (whose logits are kept; every position's with
        ``all_logits``)."""
        b, k, last = self.batch, 0, []
        for seq, tokens in enumerate(rows):
            for j, token in enumerate(tokens):
                b.token[k], b.pos[k], b.n_seq_id[k] = token, start + j, 1
                b.seq_id[k][0] = seq
                b.logits[k] = all_logits or j == len(tokens) - 1
                k += 1
            last.append(k - 1)
        b.n_tokens = k
        status = self.L.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return last

    def logits(self, index: int):
        import numpy as np

        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))


def run_llamacpp(job: dict[str, Any]) -> dict[str, Any]:
    """peer_genai's timing loop for llama.cpp: prefill of every row in one decode, then one decode of
    ``batch`` tokens per step, greedy."""
    rows, n = job["prompts"], job["new_tokens"]
    before = pg.rss_bytes()
    n_ctx, n_batch = len(rows) * job["max_seq"], sum(map(len, rows))
    llama = _Llama(job["gguf"], job["threads"], n_ctx, len(rows), n_batch, job.get("extra_bufts", True))

    def once():
        llama.clear()
        generated = []
        start = time.perf_counter()
        last = llama.decode(rows, 0)
        next_ids = [int(llama.logits(i).argmax()) for i in last]
        ttft = time.perf_counter() - start
        generated.append(next_ids)
        steps = []
        for step in range(n - 1):
            start = time.perf_counter()
            last = llama.decode([[t] for t in next_ids], len(rows[0]) + step)
            next_ids = [int(llama.logits(i).argmax()) for i in last]
            steps.append(time.perf_counter() - start)
            generated.append(next_ids)
        return ttft, steps, [list(col) for col in zip(*generated)]

    ttft, step_mean, all_steps, tokens = pg._repeat(once, job["repeat"])
    import llama_cpp

    result = pg._result(ttft, step_mean, all_steps, tokens, before)
    result["llama_cpp_python"] = llama_cpp.__version__
    result["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return result


def _load_perplexity_module(path: str):
    """kvforge.tools.perplexity by file (it imports numpy only; this venv has no kvforge)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvforge_perplexity", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def llamacpp_nll(job: dict[str, Any]) -> dict[str, Any]:
    """The NLL of the windows ``job["windows"]`` of ``job["ids"]`` under llama.cpp: every window one
    ``llama_decode`` into a cleared cache with every position's logits kept (``logits_all``)."""
    import numpy as np

    ppl = _load_perplexity_module(job["perplexity_module"])
    ids, window = job["ids"], job["window"]
    llama = _Llama(job["gguf"], job["threads"], window, 1, window)
    nll, start = [], time.perf_counter()
    for start_, end, first in job["windows"]:
        w = ppl.Window(start_, end, first)
        llama.clear()
        llama.decode([ids[w.start : w.end]], 0, all_logits=True)
        logits = np.stack([llama.logits(i) for i in range(w.end - w.start)])
        nll.append(ppl.window_nll(logits, ids, w))
    nll = np.concatenate(nll)
    return {"nll_sum": float(nll.sum()), "scored": len(nll), "seconds": time.perf_counter() - start}


def llamacpp_quantize(job: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's own quantizer: ``job["src"]`` (f16 GGUF) -> ``job["dst"]`` at ``job["ftype"]``."""
    import llama_cpp as L

    _quiet_llama(L)
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{job['ftype']}")
    params.nthread = job["threads"]
    start = time.perf_counter()
    status = L.llama_model_quantize(job["src"].encode(), job["dst"].encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")
    return {"seconds": time.perf_counter() - start}


def build_large(job: dict[str, Any]) -> dict[str, Any]:
    """A random Llama of ``LARGE``'s shape (seed 0, float16) with SmolLM2's tokenizer files."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s, path = job["shape"], Path(job["model_dir"])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=s["tied"],
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float16",
    )
    model = LlamaForCausalLM(config).half()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (Path(job["tokenizer_dir"]) / name).exists():
            shutil.copy(Path(job["tokenizer_dir"]) / name, path / name)
    return {"params": sum(p.numel() for p in model.parameters())}


def build_hybrid(job: dict[str, Any]) -> dict[str, Any]:
    """A random model of ``common.MODEL_SHAPES[job["shape"]]`` (seed 0, float32) with SmolLM2's
    tokenizer files and vocabulary size."""
    import shutil

    from common import build_shape

    path, tokenizer = Path(job["model_dir"]), Path(job["tokenizer_dir"])
    params = build_shape(job["shape"], path, vocab_size=LARGE["vocab"])
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") == "granitemoehybrid":  # layer types as Granite 4's checkpoints spell them:
        # llama.cpp's converter reads "attention" / "mamba"; transformers maps them to its own names
        spelled = {"full_attention": "attention", "linear_attention": "mamba"}
        config["layer_types"] = [spelled[t] for t in config["layer_types"]]
        (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, path / name)
    return {"params": params}


def llamacpp_probe(job: dict[str, Any]) -> dict[str, Any]:
    """One small decode of ``job["gguf"]`` with llama.cpp's CPU extra buffer types (repacked / AMX
    weights) on: a crash here (llama-cpp-python 0.3.36 segfaults so on quantized GGUFs on an Intel
    Xeon with AMX) makes that row run with them off."""
    llama = _Llama(job["gguf"], job["threads"], 64, 1, 16)
    llama.decode([list(range(100, 116))], 0)
    return {"ok": True}


WORKERS = {
    "llamacpp": run_llamacpp,
    "llamacpp-probe": llamacpp_probe,
    "llamacpp-nll": llamacpp_nll,
    "llamacpp-quantize": llamacpp_quantize,
    "build-large": build_large,
    "build-hybrid": build_hybrid,
}


def worker_main(name: str, job_file: str) -> None:
    pg.answer_job(WORKERS, name, job_file)


# ---------------------------------------------------------------------------- parent: build, run, report


def run_llama_worker(python: str, name: str, job: dict[str, Any], work: Path) -> dict[str, Any]:
    return pg.run_worker(python, name, job, work, SCRIPT)


def ensure_built(model: str, work: Path, llama_python: str, threads: int) -> tuple[Path, Path, dict[str, float]]:
    """A random model (``large``, or a hybrid of ``HYBRIDS``): its HF directory, its Q4_0 GGUF
    (through f16), and build seconds."""
    model_dir, times = work / f"model-{model}", {}
    if not (model_dir / "config.json").exists():
        pg.say(f"building the random {model} model in {model_dir}")
        start = time.perf_counter()
        job = {"model_dir": str(model_dir), "tokenizer_dir": str(SMOLLM2_HF)}
        if model == "large":
            pg.run_worker(sys.executable, "build-large", {**job, "shape": LARGE}, work, SCRIPT)
        else:
            pg.run_worker(sys.executable, "build-hybrid", {**job, "shape": model}, work, SCRIPT)
        times["build_s"] = time.perf_counter() - start
    f16, q4 = work / f"{model}-f16.gguf", work / f"{model}-Q4_0.gguf"
    if not q4.exists():
        if not f16.exists():
            times["convert_s"] = convert_to_gguf(model, model_dir, f16, "f16", work)
        pg.say(f"llama_model_quantize Q4_0 -> {q4}")
        job = {"src": str(f16), "dst": str(q4), "ftype": "Q4_0", "threads": threads}
        times["quantize_s"] = run_llama_worker(llama_python, "llamacpp-quantize", job, work)["seconds"]
    return model_dir, q4, times


def convert_to_gguf(model: str, model_dir: Path, out: Path, outtype: str, work: Path) -> float:
    """llama.cpp's own converter (the sdist's ``convert_hf_to_gguf.py``) on ``model_dir`` at
    ``outtype`` (f16, f32); its seconds."""
    source = llama_cpp_source() / "vendor" / "llama.cpp"
    pg.say(f"llama.cpp's convert_hf_to_gguf.py --outtype {outtype} -> {out}")
    start = time.perf_counter()
    cmd = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir)]
    cmd += ["--outfile", str(out), "--outtype", outtype, *CONVERT_FLAGS.get(model, [])]
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py"), **pg.OFFLINE_ENV}
    log = work / f"convert_hf_to_gguf-{model}-{outtype}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise pg.StepFailed(f"convert_hf_to_gguf failed; log {log}:\n{tail}")
    return time.perf_counter() - start


def llama_row(qtype: str, gguf: Path, llama_python: str, work: Path, threads: int) -> tuple[str, str, str, Path]:
    """llama.cpp's row of a quantized GGUF: at its defaults, or, where a decode crashes with its CPU
    extra buffer types on (:func:`llamacpp_probe`), with them off and ", no repack" in the label."""
    try:
        run_llama_worker(llama_python, "llamacpp-probe", {"gguf": str(gguf), "threads": threads}, work)
        return f"llama.cpp ({qtype} GGUF)", "llamacpp", qtype, gguf
    except pg.StepFailed as e:
        pg.say(f"llama.cpp crashed on {gguf.name} with its extra buffer types on ({str(e).splitlines()[0]}): off")
        return f"llama.cpp ({qtype} GGUF, no repack)", "llamacpp", qtype, gguf


def ensure_kvforge_artifact(source: Path, out: Path, quantize: str | None, flags: tuple[str, ...] = ()) -> Path:
    """kvforge compile at its defaults (max_batch 4, max_seq 512, score graph) except --quantize and
    ``flags`` (e.g. ``("--max-seq", "1024")``); ``source`` an HF directory or a GGUF file (whose
    Q4_0/Q8_0/Q4_1 blocks compile keeps)."""
    if not (out / "manifest.json").exists():
        cmd = [str(Path(sys.executable).parent / "kvforge"), "compile", str(source), "-o", str(out), "-q"]
        if quantize:
            cmd += ["--quantize", quantize]
        cmd += list(flags)
        pg.say(" ".join(cmd[1:]))
        pg.run_logged(cmd, out.parent / f"compile-{out.name}.log", f"kvforge compile -> {out}")
    return out


def text_prompts(batch: int, length: int, model_dir: Path) -> list[list[int]]:
    """``batch`` consecutive slices of ``length`` tokens of the quality text (benchmarks/quality.py)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(load_text(None)).ids
    return [ids[i * length : (i + 1) * length] for i in range(batch)]


def uptime() -> str:
    """`uptime`'s line (the load averages the figures stand next to)."""
    proc = subprocess.run(["uptime"], capture_output=True, text=True)
    return proc.stdout.strip() or f"load average {pg.loadavg()}"


# The GGUF-blocks side compiles the GGUF file itself; what compile does with the tensors whose type
# has no exact MatMulNBits form (the 1.39B file's tied Q6_K token_embd / lm_head): int8 blocks of
# 32, the nearest of compile's settings to Q6_K's 6.6 bits (fp32 would read 300 MB a step).
GGUF_REST = {"smollm2": None, "large": "int8"}
DEFAULT_PRECISIONS = {"smollm2": ("int4", "fp32"), "large": ("int4",), **{h: ("int4", "fp32") for h in HYBRIDS}}


def plan_sides(args: argparse.Namespace, model: str, work: Path, llama_python: str | None, builds: dict):
    """The rows of one model: ``(label, side, precision, path)``, built (compiled, converted) first."""
    precisions = args.precisions or DEFAULT_PRECISIONS[model]
    sides: list[tuple[str, str, str, Path]] = []
    if model == "smollm2":
        model_dir, gguf, qtype = args.hf_dir, args.gguf, "Q4_1"
    else:
        llama_python = llama_python or ensure_llama_venv(args.llama_venv)
        model_dir, gguf, times = ensure_built(model, work, llama_python, args.threads)
        builds.update(times)
        qtype = "Q4_0"
    if model in HYBRIDS and {"gguf", "genai"} & set(args.sides):
        pg.say(f"{model}: the GGUF-blocks and genai sides do not take this family; llama.cpp and kvforge only")
    llama_python = llama_python or ("llamacpp" in args.sides and ensure_llama_venv(args.llama_venv))
    if "llamacpp" in args.sides and model in HYBRIDS:  # llama.cpp's rows of kvforge's precisions
        if "int4" in precisions:
            sides.append(llama_row(qtype, gguf, llama_python, work, args.threads))
        if "fp32" in precisions:
            f32 = work / f"{model}-f32.gguf"
            if not f32.exists():
                builds["convert_f32_s"] = convert_to_gguf(model, model_dir, f32, "f32", work)
            sides.append(("llama.cpp (F32 GGUF)", "llamacpp", "F32", f32))
    elif "llamacpp" in args.sides:
        sides.append(llama_row(qtype, gguf, llama_python, work, args.threads))
    if "gguf" in args.sides and model not in HYBRIDS:
        rest = GGUF_REST[model]
        out = ensure_kvforge_artifact(gguf, work / f"kvforge-{model}-gguf", rest)
        sides.append(("kvforge (GGUF blocks)", "kvforge", qtype + (f" + {rest}" if rest else ""), out))
    for precision in precisions:
        if "kvforge" in args.sides:
            quantize = None if precision == "fp32" else precision
            out = ensure_kvforge_artifact(model_dir, work / f"kvforge-{model}-{precision}", quantize)
            sides.append((f"kvforge ({precision})", "kvforge", precision, out))
    for precision in precisions:
        if "genai" in args.sides and model not in HYBRIDS:
            genai_args = argparse.Namespace(
                shape=model, precision=precision, genai_python=sys.executable, rebuild=False
            )
            genai_dir, seconds = pg.ensure_genai(genai_args, model_dir, work)
            builds[f"genai_{precision}_builder_s"] = seconds
            sides.append((f"onnxruntime-genai ({precision})", "genai", precision, genai_dir))
    return model_dir, sides


def run_model(args: argparse.Namespace, model: str, work: Path, llama_python: str | None) -> dict[str, Any]:
    """Every side of ``model`` at every batch size: rounds of fresh processes, the sides taking turns."""
    builds: dict[str, Any] = {}
    model_dir, sides = plan_sides(args, model, work, llama_python, builds)
    uptime_before, load_before = uptime(), pg.loadavg()
    pg.say(f"{model}: {uptime_before}")
    quality = json.loads(args.quality.read_text()) if args.quality and model == "smollm2" else None
    tables = {}
    for batch in args.batches:
        if model == "smollm2":
            rows_in = text_prompts(batch, args.prompt_len, model_dir)
        else:
            rows_in = pg.prompts(batch, args.prompt_len, LARGE["vocab"])
        base = {"prompts": rows_in, "new_tokens": args.new_tokens, "repeat": args.repeat, "threads": args.threads}
        plan = []
        for label, side, _, path in sides:
            if side == "llamacpp":
                job = {**base, "gguf": str(path), "max_seq": args.max_seq}
                job["extra_bufts"] = not label.endswith("no repack)")
                plan.append((label, llama_python, "llamacpp", job, SCRIPT))
            elif side == "kvforge":
                plan.append((label, sys.executable, "kvforge", {**base, "out": str(path)}, None))
            else:  # genai: its KV buffer holds max_length tokens a row, the others' max_seq
                pg.set_genai_threads(path, args.threads)
                job = {**base, "genai_dir": str(path), "max_length": args.max_seq}
                plan.append((label, sys.executable, "genai", job, None))
        per_round, rows = pg.run_rounds(plan, args.rounds, work)
        for label, *_ in plan:
            if label not in rows:
                rows[label] = pg.combine_rounds(per_round[label])
                rows[label]["decode_tokens_per_s"] = batch * 1e3 / rows[label]["decode_ms_step"]
        reference = _reference_row(model, rows)
        for label, _, precision, _ in sides:
            rows[label]["precision"] = precision
        for label, r in rows.items():
            if "tokens" in r and reference and label != reference:
                r["agreement_vs"] = reference
                r["agreement"] = pg.agreement(r["tokens"], rows[reference]["tokens"])
            r["perplexity"] = _perplexity_of(quality, label)
        tables[f"batch {batch}"] = rows
    return {
        "model_name": model,
        "model": str(model_dir),
        "sides": [{"label": s[0], "side": s[1], "precision": s[2], "path": str(s[3])} for s in sides],
        "builds": builds,
        "uptime_before": uptime_before,
        "uptime_after": uptime(),
        "loadavg_before": load_before,
        "loadavg_after": pg.loadavg(),
        "tables": tables,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", choices=MODELS, default=["smollm2"], help="one report each")
    p.add_argument("--gguf", type=Path, default=SMOLLM2_GGUF, help="--model smollm2: the Q4_1 GGUF file")
    p.add_argument("--hf-dir", type=Path, default=SMOLLM2_HF, help="--model smollm2: the HF directory of that file")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=("int4", "int8", "fp32"),
        default=None,
        help="kvforge's and genai's rows (default: int4 fp32 for smollm2, int4 for large)",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="one table per batch size")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--max-seq",
        type=int,
        default=pg.DEFAULT_MAX_SEQ,
        help="KV capacity per sequence, every side: kvforge's compile default, llama.cpp's n_ctx / n_seq_max, "
        "genai's max_length",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--llama-venv", type=Path, default=CACHE / "llamacpp-venv")
    p.add_argument("--work-dir", type=Path, default=CACHE / "work")
    p.add_argument("--quality", type=Path, default=None, help="benchmarks/quality.py's JSON: perplexity per row")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.job)
        return
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    llama_python = ensure_llama_venv(args.llama_venv) if "llamacpp" in args.sides else None
    env = {
        "cpu_count": os.cpu_count(),
        "llama_cpp_python": installed_version(Path(llama_python)) if llama_python else None,
        **{d: pg.version(d) for d in ("onnxruntime", "onnxruntime-genai", "kvforge")},
        "commit": _commit(),
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("worker", "job")}
    reports = []
    for model in args.model:
        report = {"schema": "kvforge.peer_llamacpp", "config": config, "env": env}
        report.update(run_model(args, model, work, llama_python))
        reports.append(report)
        print(format_report(report), flush=True)
        if args.json:  # after every model: a later one may fail
            args.json.write_text(json.dumps(reports if len(args.model) > 1 else report, indent=2))
            pg.say(f"wrote {args.json}")


def _reference_row(model: str, rows: dict[str, dict[str, Any]]) -> str | None:
    if model == "smollm2":
        want = "kvforge (fp32)"
    elif "llama.cpp (F32 GGUF)" in rows:  # a hybrid's: the row kvforge fp32 must equal to the token
        want = "llama.cpp (F32 GGUF)"
    else:  # llama.cpp's Q4_0 row (a hybrid's says "no repack")
        want = next((label for label in rows if label.startswith("llama.cpp (Q4_0 GGUF")), None)
    return want if want in rows and "tokens" in rows[want] else None


# The llama.cpp row a kvforge row is compared with: the one of its precision where there is one
# (a hybrid's F32 GGUF for kvforge fp32), else the first llama.cpp row.
LLAMA_PRECISION_OF = {"fp32": "F32"}


def _llama_row_for(r: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    llamas = [x for label, x in rows.items() if label.startswith("llama.cpp") and "error" not in x]
    same = [x for x in llamas if x.get("precision") == LLAMA_PRECISION_OF.get(r.get("precision"))]
    return next(iter(same or llamas), None)


QUALITY_ROWS = {  # peer row label -> benchmarks/quality.py row name
    "llama.cpp (Q4_1 GGUF)": "llama.cpp Q4_1 GGUF",
    "kvforge (int4)": "kvforge int4 b32 sym",
    "kvforge (fp32)": "kvforge fp32",
    "kvforge (GGUF blocks)": "kvforge GGUF blocks (compile file.gguf)",
}


def _perplexity_of(quality: dict[str, Any] | None, label: str) -> float | None:
    if not quality:
        return None
    row = quality["rows"].get(QUALITY_ROWS.get(label, ""), {})
    return row.get("perplexity")


def _commit() -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(SCRIPT.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() or None


def format_report(report: dict[str, Any]) -> str:
    env, cfg = report["env"], report["config"]
    lines = [
        f"{report['model']}: prompt {cfg['prompt_len']}, {cfg['new_tokens']} new tokens, threads {cfg['threads']}, "
        f"KV capacity {cfg['max_seq']} a sequence, {cfg['rounds']} rounds x {cfg['repeat']} (medians); "
        f"llama-cpp-python {env['llama_cpp_python']}, onnxruntime {env['onnxruntime']}, "
        f"genai {env['onnxruntime-genai']}; commit {env['commit']}",
        f"uptime before: {report['uptime_before']}",
        f"uptime after:  {report['uptime_after']}",
    ]
    for name, rows in report["tables"].items():
        lines.append(f"\n{name}")
        lines.append(f"{'':30}{'TTFT ms':>9}{'ms/step':>9}{'tok/s':>8}{'peak RSS':>9}{'ppl':>8}  vs llama.cpp  greedy")
        for label, r in rows.items():
            llama = _llama_row_for(r, rows)
            if "error" in r:
                lines.append(f"{label:30}  failed: {r['error'].splitlines()[0]}")
                continue
            ppl_text = f"{r['perplexity']:8.2f}" if r.get("perplexity") else f"{'-':>8}"
            agree = f"{r['agreement']} vs {r['agreement_vs']}" if r.get("agreement") else ""
            ratio = ""
            if llama is not None and not label.startswith("llama.cpp"):  # < 1: faster than llama.cpp
                ratio = f"x{r['ttft_ms'] / llama['ttft_ms']:.2f} x{r['decode_ms_step'] / llama['decode_ms_step']:.2f}"
            lines.append(
                f"{label:30}{r['ttft_ms']:9.1f}{r['decode_ms_step']:9.2f}{r['decode_tokens_per_s']:8.1f}"
                f"{r['rss_peak_bytes'] / 2**20:9.0f}{ppl_text}  {ratio:12} {agree}"
            )
    lines.append("(vs llama.cpp: TTFT and ms/step ratios, < 1 faster than llama.cpp)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
