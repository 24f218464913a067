"""kvforge vs onnxruntime-genai vs transformers eager: one model, the same prompts, one run, ratios.

Builds a random Llama of a named shape (no download), turns that one Hugging Face directory into a
kvforge artifact (``compile_model``) and into an onnxruntime-genai model (its own builder,
``python -m onnxruntime_genai.models.builder -i MODEL_DIR``), then runs each side in its own
subprocess, so every side's peak RSS is its own. Each side gets the same ``B`` random prompts of
exactly ``--prompt-len`` tokens (seeded, token ids, no tokenizer in the loop) and decodes
``--new-tokens`` greedy tokens per row without stopping at eos.

* TTFT: prompt in until the first token of every row is known. kvforge:
  ``Engine.prefill_prompt`` (calls of ``chunk_tokens``, as generation prefills) plus argmax;
  genai: ``Generator.append_tokens`` plus the first ``generate_next_token``; transformers:
  ``generate(max_new_tokens=1)``, the fastest of three such calls.
* decode ms/step: the time of the N-1 decode steps divided by N-1 (for transformers
  ``(t_N - t_1) / (N - 1)`` from two ``generate`` calls). kvforge and genai also report the median
  single step (``decode_ms_step_p50``, the median over the rounds of each round's median over its steps).
* Rounds: the sides take turns, ``--rounds`` times (default 3): each round starts every side's
  worker once (a fresh process: one untimed warm-up, then ``--repeat`` timed runs), so a change in
  the machine's load or memory bandwidth during the run falls on every side alike. Every number
  is the median over the rounds (peak RSS: the highest round).
* peak RSS: the worker process's ``VmHWM`` (Python and what the side imports: torch for
  transformers, numpy and onnxruntime for kvforge and genai);
  ``+RSS``: that peak minus the RSS just before the side loaded its model.
* Threads: every side gets the same intra-op thread count, ``--threads`` (default: the machine's
  cores, ``os.cpu_count()``): genai through its genai_config.json session options
  (``intra_op_num_threads``), kvforge through ``Engine.load(threads=)``, transformers through
  ``torch.set_num_threads``. ``--peer-defaults`` adds a row per peer on its own default threads.
* Roofline: a memory-bandwidth read of a buffer much larger than the caches (``--roofline-gib``,
  default 1 GiB of float64, summed by ``--threads`` threads, best of ``--roofline-repeat``), measured
  in a worker before and after the sides run. Each side's decode step is reported as a fraction of it:
  (weight bytes a decode step reads) / (step time) / (bandwidth), the weight bytes being those of
  every MatMul / Gemm / MatMulNBits weight of the graph the side runs (a tied lm_head counted once)
  plus one row of the embedding table.

Built artifacts are cached under ``--work-dir`` (keyed by shape, precision, limits and a hash of
kvforge's compile code), so a rerun only measures. Setup and examples: benchmarks/README.md.

    python benchmarks/peer_genai.py --shape tiny4
    python benchmarks/peer_genai.py --shape smollm --lowering onnx gqa --json peer.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SIDES = ("transformers", "genai", "kvforge")
PRECISIONS = ("fp32", "int4", "int8")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
DEFAULT_MAX_SEQ = 512  # compile's default max_seq (kvforge.compile.pipeline; not imported: it pulls in torch)


@dataclass(frozen=True)
class Shape:
    """A Llama shape; ``eos_token_id`` exists only because genai's builder requires one."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int = 2048
    eos_token_id: int = 0


SHAPES = {
    # SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M config), random weights.
    "smollm": Shape(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152, tied=True),
    # benchmarks/decode_speed.py's default model.
    "tiny4": Shape(layers=4, hidden=256, heads=8, kv_heads=4, intermediate=1024, vocab=32000, tied=False),
}

TOKENIZER_TEXT = (
    "The for statement iterates over the items of any sequence. A list is a mutable sequence. "
    "Functions are defined with def and return a value. Classes bundle data and behaviour together."
)


# ---------------------------------------------------------------------------- memory and env


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else None


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def source_hash(*packages: str) -> str:
    """A short hash of the Python sources of ``packages``: a cached artifact is rebuilt when they change."""
    import importlib.util

    digest = hashlib.sha256()
    for name in packages:
        spec = importlib.util.find_spec(name)
        for root in spec.submodule_search_locations or []:
            for f in sorted(Path(root).rglob("*.py")):
                digest.update(f.name.encode())
                digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


# ---------------------------------------------------------------------------- workers (subprocesses)


def prompts(batch: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """``batch`` rows of ``length`` random ids in ``[2, vocab)``, the same for every side (numpy seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab, (batch, length)).tolist()


def build_model(job: dict[str, Any]) -> dict[str, Any]:
    """Save a random Llama of ``job["shape"]`` plus a tiny byte-level BPE tokenizer (genai's builder
    reads one for its special ids; the benchmark itself feeds token ids)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    shape, path = Shape(**job["shape"]), Path(job["model_dir"])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=shape.tied,
        bos_token_id=None,
        eos_token_id=shape.eos_token_id,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(shape.vocab, 512),
        special_tokens=["<|endoftext|>"],  # id 0 = eos_token_id
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    return {"params": sum(p.numel() for p in model.parameters())}


def compile_kvforge(job: dict[str, Any]) -> dict[str, Any]:
    import inspect

    from kvforge.compile import compile_model

    kwargs = dict(max_batch=job["batch"], max_seq=job["max_seq"], lowering=job["lowering"], progress=None)
    if job["quantize"]:
        kwargs["quantize"] = job["quantize"]  # the parent checked that compile_model accepts it
    if "score_graph" in inspect.signature(compile_model).parameters:
        kwargs["score_graph"] = False  # the benchmark never runs it
    if job.get("pack_tied_lm_head") is not None:  # None: compile's default
        kwargs["pack_tied_lm_head"] = job["pack_tied_lm_head"]
    start = time.perf_counter()
    compile_model(job["model_dir"], job["out"], **kwargs)
    return {"compile_s": time.perf_counter() - start}


def _result(ttft: list[float], step_mean: list[float], steps: list[float], tokens, before: int | None) -> dict:
    peak = peak_rss_bytes()
    return {
        "ttft_ms": 1e3 * statistics.median(ttft),
        "decode_ms_step": 1e3 * statistics.median(step_mean),
        "decode_ms_step_p50": 1e3 * statistics.median(steps) if steps else None,
        "rss_peak_bytes": peak,
        "rss_added_bytes": peak - before if before is not None else None,
        "tokens": tokens,
    }


def combine_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a side's rounds: the median of each time over the rounds, the highest peak RSS,
    the first round's tokens (and whether every round generated the same), every round's figures."""

    def median(key: str) -> float | None:
        values = [r[key] for r in results if r.get(key) is not None]
        return statistics.median(values) if values else None

    peak = max(results, key=lambda r: r["rss_peak_bytes"])
    return {
        "ttft_ms": median("ttft_ms"),
        "decode_ms_step": median("decode_ms_step"),
        "decode_ms_step_p50": median("decode_ms_step_p50"),
        "rss_peak_bytes": peak["rss_peak_bytes"],
        "rss_added_bytes": peak["rss_added_bytes"],
        "tokens": results[0]["tokens"],
        "same_tokens_every_round": all(r["tokens"] == results[0]["tokens"] for r in results),
        "rounds": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
        **{k: v for k, v in results[0].items() if k not in _ROUND_KEYS},
    }


_ROUND_KEYS = {"ttft_ms", "decode_ms_step", "decode_ms_step_p50", "rss_peak_bytes", "rss_added_bytes", "tokens"}


def run_transformers(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    before = rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], attn_implementation="eager").eval()
    ids = torch.tensor(job["prompts"])
    n = job["new_tokens"]

    def generate(k: int) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                pad_token_id=job["eos_token_id"],
            )
        return time.perf_counter() - start, out

    _, out = generate(n)  # warm-up
    tokens = out[:, ids.shape[1] :].tolist()
    ttft, step_mean = [], []
    for _ in range(job["repeat"]):
        # The fastest of three one-token calls: the step is what N tokens add to it, and one call's
        # hiccup (a 250 ms TTFT on the tiny model, once) made that difference negative.
        t1 = min(generate(1)[0] for _ in range(3))
        tn, _ = generate(n)
        ttft.append(t1)
        step_mean.append((tn - t1) / (n - 1))
    result = _result(ttft, step_mean, [], tokens, before)
    result["torch_threads"] = torch.get_num_threads()  # what it ran on (the default, without --threads)
    return result


def run_genai(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import onnxruntime_genai as og

    before = rss_bytes()
    model = og.Model(job["genai_dir"])
    ids = np.asarray(job["prompts"], dtype=np.int32)
    batch, length = ids.shape
    n = job["new_tokens"]

    # The KV buffer (past_present_share_buffer) holds max_length tokens a row: by default exactly the
    # prompt and the new tokens; job["max_length"] gives it another side's capacity.
    max_length = job.get("max_length") or length + n

    def once() -> tuple[float, list[float], list[list[int]]]:
        params = og.GeneratorParams(model)
        # min_length: never stop at eos, like the other sides.
        params.set_search_options(max_length=max_length, min_length=max_length, do_sample=False, batch_size=batch)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(ids)  # prefill: computes the logits of the last position
        generator.generate_next_token()  # picks the first token (no model run)
        ttft = time.perf_counter() - start
        steps = []
        for _ in range(n - 1):
            start = time.perf_counter()
            generator.generate_next_token()  # one decode run + greedy pick
            steps.append(time.perf_counter() - start)
        tokens = [generator.get_sequence(b)[length:].tolist() for b in range(batch)]
        del generator
        return ttft, steps, tokens

    ttft, step_mean, all_steps, tokens = _repeat(once, job["repeat"])
    return _result(ttft, step_mean, all_steps, tokens, before)


def _repeat(once, repeat: int) -> tuple[list[float], list[float], list[float], list[list[int]]]:
    """One warm-up call of ``once() -> (ttft, step times, tokens)``, then ``repeat`` timed ones:
    TTFTs, mean step time per run, every step time, and the warm-up's tokens."""
    _, _, tokens = once()
    ttft, step_mean, all_steps = [], [], []
    for _ in range(repeat):
        t, steps, _ = once()
        ttft.append(t)
        step_mean.append(sum(steps) / len(steps))
        all_steps += steps
    return ttft, step_mean, all_steps, tokens


def run_kvforge(job: dict[str, Any]) -> dict[str, Any]:
    import inspect

    import numpy as np

    from kvforge.runtime import Engine  # no torch: the runtime imports numpy and onnxruntime only

    load_kwargs, accepted = {}, inspect.signature(Engine.load).parameters  # older kvforge: fewer options
    if job["threads"] and "threads" in accepted:
        load_kwargs["threads"] = job["threads"]
    if job.get("prepack") is not None:
        load_kwargs["prepack"] = job["prepack"]
    if job.get("spin") is not None:
        load_kwargs["spin"] = job["spin"]
    if job.get("prefill", "ort") != "ort":
        load_kwargs["prefill"] = job["prefill"]  # where long prefill calls run (peer_openvino.py)
    if "one_session" in accepted:
        load_kwargs["one_session"] = job.get("one_session", True)
    before = rss_bytes()
    rows, n = job["prompts"], job["new_tokens"]
    with Engine.load(job["out"], **load_kwargs) as engine:
        next_ids = np.zeros(len(rows), dtype=np.int64)
        prefill = getattr(engine, "prefill_prompt", engine.prefill)  # in chunks, as generation prefills

        def once() -> tuple[float, list[float], list[list[int]]]:
            generated = []
            start = time.perf_counter()
            np.argmax(prefill(rows), axis=-1, out=next_ids)
            ttft = time.perf_counter() - start
            generated.append(next_ids.tolist())
            steps = []
            for _ in range(n - 1):
                start = time.perf_counter()
                np.argmax(engine.decode(next_ids), axis=-1, out=next_ids)
                steps.append(time.perf_counter() - start)
                generated.append(next_ids.tolist())
            return ttft, steps, [list(col) for col in zip(*generated)]

        ttft, step_mean, all_steps, tokens = _repeat(once, job["repeat"])
        kv_bytes = engine.cache.nbytes
    result = _result(ttft, step_mean, all_steps, tokens, before)
    result["kv_cache_bytes"] = kv_bytes
    return result


def measure_bandwidth(job: dict[str, Any]) -> dict[str, Any]:
    """Memory read bandwidth: ``job["bytes"]`` of float64 ones (every page touched at allocation, so
    the timed passes read resident memory) split into ``job["threads"]`` contiguous chunks, each summed
    by its own thread (numpy releases the GIL in the reduction); the best of ``job["repeat"]`` passes.

    The buffer is far larger than the last-level cache, so a pass streams it from DRAM: the rate a
    decode step that reads every weight once cannot beat."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    threads = max(1, job["threads"])
    buffer = np.ones(job["bytes"] // 8, dtype=np.float64)
    chunks = np.array_split(buffer, threads)
    times = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(job["repeat"]):
            start = time.perf_counter()
            total = sum(pool.map(np.sum, chunks))
            times.append(time.perf_counter() - start)
    if total != buffer.size:  # every element is 1.0: the passes really read the whole buffer
        raise RuntimeError(f"bandwidth pass summed {total}, expected {buffer.size}")
    return {
        "bytes": buffer.nbytes,
        "threads": threads,
        "pass_s": times,
        "bytes_per_s": buffer.nbytes / min(times),
    }


WORKERS = {
    "roofline": measure_bandwidth,
    "build-model": build_model,
    "compile-kvforge": compile_kvforge,
    "transformers": run_transformers,
    "genai": run_genai,
    "kvforge": run_kvforge,
}


def answer_job(workers: dict, name: str, job_file: str) -> None:
    """A worker process of any peer script: run ``workers[name]`` on the job file's job and write
    its JSON result where the job says."""
    job = json.loads(Path(job_file).read_text())
    Path(job["result_file"]).write_text(json.dumps(workers[name](job)))


def worker_main(name: str, job_file: str) -> None:
    answer_job(WORKERS, name, job_file)


# ---------------------------------------------------------------------------- parent: build, run, report


class StepFailed(RuntimeError):
    pass


def run_logged(cmd: list[str], log: Path, what: str) -> None:
    """Run ``cmd`` offline with its output in ``log``; on failure raise with the log's tail."""
    env = {**os.environ, **OFFLINE_ENV}
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise StepFailed(f"{what} failed (exit {proc.returncode}); log {log}:\n{tail}")


def run_worker(python: str, name: str, job: dict[str, Any], work: Path, script: Path | None = None) -> dict[str, Any]:
    """Run worker ``name`` of ``script`` (default: this file; another benchmark that imports this
    one passes its own, whose ``--worker NAME --job FILE`` does the same) under ``python`` in a
    fresh process; returns the dict it wrote."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        job = {**job, "result_file": str(Path(tmp) / "result.json")}
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        log = work / f"{name}.log"
        script = (script or Path(__file__)).resolve()
        run_logged([python, str(script), "--worker", name, "--job", str(job_file)], log, name)
        return json.loads(Path(job["result_file"]).read_text())


def run_rounds(
    plan: list[tuple[str, str, str, dict[str, Any], Path | None]],
    rounds: int,
    work: Path,
    before=None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """The sides take turns: ``rounds`` times, each ``(row name, interpreter, worker, job, script)``
    of ``plan`` runs once in a fresh process (``before(name, job)`` first, where given). Returns
    every row's per-round results and the rows that failed (``{"error": ...}``; a failed row is
    not run again)."""
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in plan}
    failed: dict[str, dict[str, Any]] = {}
    for round_ in range(rounds):
        for name, python, worker, job, script in plan:
            if name in failed:
                continue
            say(f"round {round_ + 1}/{rounds}: running {name}")
            if before is not None:
                before(name, job)
            try:
                per_round[name].append(run_worker(python, worker, job, work, script))
            except StepFailed as e:
                say(str(e))
                failed[name] = {"error": str(e)}
    return per_round, failed


def say(message: str) -> None:
    print(f"[peer] {message}", file=sys.stderr, flush=True)


def ensure_model(args: argparse.Namespace, shape: Shape, work: Path) -> Path:
    model_dir = work / f"model-{args.shape}"
    if not (model_dir / "tokenizer.json").exists() or args.rebuild:
        say(f"building the random {args.shape} Llama in {model_dir}")
        run_worker(sys.executable, "build-model", {"shape": asdict(shape), "model_dir": str(model_dir)}, work)
    return model_dir


def ensure_genai(args: argparse.Namespace, model_dir: Path, work: Path) -> tuple[Path, float | None]:
    out = work / f"genai-{args.shape}-{args.precision}-og{version('onnxruntime-genai')}"
    if (out / "genai_config.json").exists() and not args.rebuild:
        return out, None
    say(f"onnxruntime-genai builder: -p {args.precision} -e cpu -> {out}")
    start = time.perf_counter()
    cmd = [args.genai_python, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out)]
    cmd += ["-p", args.precision, "-e", "cpu", "-c", str(work / "genai-cache")]
    run_logged(cmd, work / f"genai-builder-{args.shape}-{args.precision}.log", "onnxruntime-genai builder")
    return out, time.perf_counter() - start


def set_genai_threads(genai_dir: Path, threads: int | None) -> None:
    """genai takes its ONNX Runtime thread count from genai_config.json (session_options)."""
    config_file = genai_dir / "genai_config.json"
    config = json.loads(config_file.read_text())
    options = config["model"]["decoder"]["session_options"]
    if threads:
        options["intra_op_num_threads"] = threads
    else:
        options.pop("intra_op_num_threads", None)
    config_file.write_text(json.dumps(config, indent=4))


MATMUL_OPS = {"MatMul", "Gemm", "MatMulNBits", "FusedMatMul", "MatMulInteger", "DynamicQuantizeMatMul"}
GATHER_OPS = {"Gather", "GatherBlockQuantized"}


def graph_weight_bytes_per_step(graph_file: Path) -> dict[str, int]:
    """Bytes of weights one decode step of ``graph_file`` reads: every initializer feeding a MatMul-like
    op (MatMul, Gemm, MatMulNBits with its scales and zero points, ...), each counted once (a tied
    lm_head reads the embedding table once), plus one row of each embedding table a Gather reads and
    no MatMul does. Sizes come from the initializers' dims and types; the data is not loaded."""
    import onnx

    model = onnx.load(str(graph_file), load_external_data=False)
    sizes = {}
    for init in model.graph.initializer:
        count = 1
        for d in init.dims:
            count *= d
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        if init.data_type in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4):
            sizes[init.name] = ((count + 1) // 2, list(init.dims))
        else:
            sizes[init.name] = (count * itemsize, list(init.dims))
    matmul, tables = set(), set()
    for node in model.graph.node:
        if node.op_type in MATMUL_OPS:
            matmul.update(name for name in node.input if name in sizes)
        elif node.op_type in GATHER_OPS and node.input and node.input[0] in sizes:
            tables.add(node.input[0])
    matmul_bytes = sum(sizes[name][0] for name in matmul)
    row_bytes = sum(sizes[t][0] // max(1, sizes[t][1][0]) for t in tables - matmul if sizes[t][1])
    return {"matmul_bytes": matmul_bytes, "embedding_row_bytes": row_bytes, "bytes": matmul_bytes + row_bytes}


def fp32_weight_bytes_per_step(shape: Shape) -> dict[str, int]:
    """The same count for the fp32 checkpoint transformers runs, from the shape: q, k, v, o, gate,
    up, down of every layer, the lm_head (the tied embedding table, once), one embedding row when
    untied."""
    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    per_layer = shape.hidden * q + 2 * shape.hidden * kv + q * shape.hidden + 3 * shape.hidden * shape.intermediate
    matmul = 4 * (shape.layers * per_layer + shape.vocab * shape.hidden)
    row = 0 if shape.tied else 4 * shape.hidden
    return {"matmul_bytes": matmul, "embedding_row_bytes": row, "bytes": matmul + row}


def kvforge_decode_graph(artifact: Path) -> Path:
    """The portable graph a kvforge decode step runs: ``prefill`` (``Engine.load(one_session=True)``,
    the default) or ``decode``; the same weights either way."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    graphs = manifest["graphs"]
    return artifact / graphs.get("prefill", graphs.get("decode"))["file"]


def kvforge_quantize_supported() -> bool:
    import inspect

    from kvforge.compile import compile_model

    return "quantize" in inspect.signature(compile_model).parameters


def ensure_kvforge(
    args: argparse.Namespace, model_dir: Path, work: Path, lowering: str, quantize: str | None
) -> tuple[Path, float | None]:
    max_seq = args.max_seq or DEFAULT_MAX_SEQ
    packed = getattr(args, "pack_tied_lm_head", None)
    in_place = "-inplacelm" if packed is False else ""
    tag = f"{args.shape}-{lowering}-{quantize or 'fp32'}-b{args.batch}-s{max_seq}{in_place}"
    out = work / f"kvforge-{tag}-{source_hash('kvforge.compile', 'kvforge.graphs')}"
    if (out / "manifest.json").exists() and not args.rebuild:
        return out, None
    say(f"kvforge compile --lowering {lowering}{f' --quantize {quantize}' if quantize else ''} -> {out}")
    job = {
        "model_dir": str(model_dir),
        "out": str(out),
        "batch": args.batch,
        "max_seq": max_seq,
        "lowering": lowering,
        "quantize": quantize,
        "pack_tied_lm_head": packed,
    }
    result = run_worker(sys.executable, "compile-kvforge", job, work)
    return out, result["compile_s"]


def dir_bytes(path: Path, suffixes: tuple[str, ...] = ()) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and (not suffixes or f.suffix in suffixes))


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """Leading greedy tokens equal to the reference's, per row: ``64/64`` (or ``12/64 3/64`` for a batch)."""

    from kvforge.runtime.kv.prefix_pool import common_prefix

    return " ".join(f"{common_prefix(list(a), list(b))}/{len(b)}" for a, b in zip(tokens, reference))


def print_table(report: dict[str, Any]) -> None:
    cfg, rows, env = report["config"], report["rows"], report["env"]
    weights = report["model"]["weight_bytes"]
    roof = report["roofline"]
    print(
        f"\n{cfg['shape']}: {report['model']['description']}; batch {cfg['batch']}, prompt {cfg['prompt_len']}, "
        f"{cfg['new_tokens']} new tokens, {cfg['rounds']} rounds x {cfg['repeat']} runs (medians), "
        f"precision {cfg['precision']}"
    )
    print(
        f"threads {cfg['threads']} (of {env['cpu_count']} cores); kvforge max_seq {cfg['max_seq']}, genai max_length "
        f"{cfg['prompt_len'] + cfg['new_tokens']}; load avg {env['loadavg_before']} -> {env['loadavg_after']}"
    )
    if roof:
        print(
            f"roofline: read bandwidth {roof['bytes_per_s'] / 1e9:.1f} GB/s ({roof['buffer_bytes'] / 2**30:.2g} GiB "
            f"summed by {roof['threads']} threads, best of {roof['repeat']}; "
            f"before {roof['before_bytes_per_s'] / 1e9:.1f}, after {roof['after_bytes_per_s'] / 1e9:.1f} GB/s)"
        )
    header = f"{'':38}{'thr':>4}{'TTFT ms':>9}{'ms/step':>9}{'p50 step':>9}{'tok/s':>8}"
    print(header + f"{'wts/step':>9}{'roof ms':>8}{'of roof':>8}{'peak RSS':>9}{'+RSS':>6}{'RSS/wts':>8}  greedy vs hf")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:38}  failed: {r['error'].splitlines()[0]}")
            continue
        p50 = f"{r['decode_ms_step_p50']:9.2f}" if r.get("decode_ms_step_p50") else f"{'-':>9}"
        added = f"{r['rss_added_bytes'] / 2**20:6.0f}" if r.get("rss_added_bytes") is not None else f"{'-':>6}"
        step_bytes = r.get("weight_bytes_per_step")
        wts = f"{step_bytes / 2**20:9.0f}" if step_bytes else f"{'-':>9}"
        roof_ms = f"{r['roofline_ms_step']:8.2f}" if r.get("roofline_ms_step") else f"{'-':>8}"
        frac = f"{r['roofline_fraction']:8.0%}" if r.get("roofline_fraction") else f"{'-':>8}"
        print(
            f"{name:38}{r['threads_label']:>4}{r['ttft_ms']:9.1f}{r['decode_ms_step']:9.2f}{p50}"
            f"{r['decode_tokens_per_s']:8.1f}{wts}{roof_ms}{frac}"
            f"{r['rss_peak_bytes'] / 2**20:9.0f}{added}{r['rss_peak_bytes'] / weights:8.2f}  {r.get('agreement', '')}"
        )
    print(
        "(thr: intra-op threads, 'def' = the library's own default; wts/step: MiB of weights a decode step reads; "
        "roof ms: wts/step / bandwidth; of roof: roof ms / ms/step; RSS in MiB; RSS/wts = peak RSS / fp32 "
        "checkpoint; ratios below = kvforge / peer, < 1: kvforge less)"
    )
    for key, ratio in report["ratios"].items():
        print(
            f"{key:50} TTFT x{ratio['ttft_ms']:.2f}  ms/step x{ratio['decode_ms_step']:.2f}  "
            f"peak RSS x{ratio['rss_peak_bytes']:.2f}"
        )
    for note in report["notes"]:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="genai builder precision (-p)")
    p.add_argument(
        "--quantize",
        choices=("none", "int4", "int8"),
        default=None,
        help="kvforge weight quantization, where compile_model accepts it (default: --precision unless fp32)",
    )
    p.add_argument("--lowering", nargs="+", choices=("onnx", "gqa"), default=["gqa"], help="one kvforge row each")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--max-seq",
        type=int,
        default=None,
        help=f"kvforge's compile max_seq (default: compile's own, {DEFAULT_MAX_SEQ}); genai's buffer is "
        "prompt + new tokens, the max_length each of its generators gets",
    )
    p.add_argument("--rounds", type=int, default=3, help="turns every side takes, alternating (medians over them)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per side per round, after one warm-up")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads for every side (default: the machine's cores, os.cpu_count())",
    )
    p.add_argument(
        "--peer-defaults",
        action="store_true",
        help="also run genai and transformers on their own default thread counts (one 'defaults' row each)",
    )
    p.add_argument(
        "--roofline-gib",
        type=float,
        default=1.0,
        help="GiB read by the bandwidth roofline (0: skip it); far above the last-level cache",
    )
    p.add_argument("--roofline-repeat", type=int, default=5, help="bandwidth passes; the best counts")
    p.add_argument(
        "--no-prepack",
        dest="prepack",
        action="store_const",
        const=False,
        default=None,
        help="kvforge: Engine.load(prepack=False), one shared memory-mapped copy of the weights",
    )
    p.add_argument(
        "--no-spin",
        dest="spin",
        action="store_const",
        const=False,
        default=None,
        help="kvforge: Engine.load(spin=False), idle ORT threads block instead of spinning (a shared machine)",
    )
    p.add_argument(
        "--pack-tied-lm-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kvforge: compile with pack_tied_lm_head=True/False (default: compile's own, packed; --no-...: "
        "the tied lm_head reads the table in place, unpacked)",
    )
    p.add_argument(
        "--two-sessions",
        action="store_true",
        help="kvforge: Engine.load(one_session=False), decode steps on the decode graph's own session",
    )
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvforge-peer")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached model and artifacts")
    p.add_argument(
        "--genai-python",
        default=sys.executable,
        help="interpreter with onnxruntime-genai installed, for its builder and its side (a separate venv)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.job)
        return
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (one decode step)")
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.roofline_repeat < 1:
        p.error(f"--roofline-repeat must be at least 1, got {args.roofline_repeat}")
    if args.rounds < 1 or args.repeat < 1:
        p.error(f"--rounds and --repeat must be at least 1, got {args.rounds} and {args.repeat}")

    shape = SHAPES[args.shape]
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    quantize = args.quantize or (args.precision if args.precision != "fp32" else "none")
    quantize = None if quantize == "none" else quantize
    if quantize and "kvforge" in args.sides and not kvforge_quantize_supported():
        msg = f"kvforge {quantize}: not available in this version (compile_model has no quantize); kvforge runs fp32"
        print(msg)
        notes.append(msg)
        quantize = None
    if args.precision != "fp32" and "transformers" in args.sides:
        notes.append("transformers eager runs the fp32 checkpoint")

    loadavg_before = loadavg()
    model_dir = ensure_model(args, shape, work)
    weight_bytes = dir_bytes(model_dir, (".safetensors",))
    builds: dict[str, float | None] = {}
    genai_dir = None
    if "genai" in args.sides:
        genai_dir, builds["genai_builder_s"] = ensure_genai(args, model_dir, work)
    artifacts = {}
    if "kvforge" in args.sides:
        for lowering in args.lowering:
            artifacts[lowering], builds[f"kvforge_{lowering}_compile_s"] = ensure_kvforge(
                args, model_dir, work, lowering, quantize
            )

    rows_in = prompts(args.batch, args.prompt_len, shape.vocab)
    base_job = {
        "model_dir": str(model_dir),
        "prompts": rows_in,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "threads": args.threads,
        "prepack": args.prepack,
        "spin": args.spin,
        "one_session": not args.two_sessions,
        "eos_token_id": shape.eos_token_id,
    }
    # (row name, interpreter, worker, job, weight bytes a decode step reads); job["threads"] None:
    # the library's own default (the --peer-defaults rows).
    plan: list[tuple[str, str, str, dict[str, Any], dict[str, int]]] = []
    if "transformers" in args.sides:
        step_bytes = fp32_weight_bytes_per_step(shape)
        plan.append(("transformers eager (fp32)", sys.executable, "transformers", base_job, step_bytes))
        if args.peer_defaults:
            defaults = {**base_job, "threads": None}
            plan.append(("transformers eager (fp32) defaults", sys.executable, "transformers", defaults, step_bytes))
    if genai_dir is not None:
        genai_job = {**base_job, "genai_dir": str(genai_dir)}
        step_bytes = graph_weight_bytes_per_step(genai_dir / "model.onnx")
        plan.append((f"onnxruntime-genai ({args.precision})", args.genai_python, "genai", genai_job, step_bytes))
        if args.peer_defaults:
            defaults = {**genai_job, "threads": None}
            name = f"onnxruntime-genai ({args.precision}) defaults"
            plan.append((name, args.genai_python, "genai", defaults, step_bytes))
    for lowering, out in artifacts.items():
        kvforge_job = {**base_job, "out": str(out)}
        step_bytes = graph_weight_bytes_per_step(kvforge_decode_graph(out))
        packed = ", lm_head in place" if args.pack_tied_lm_head is False else ""
        label = f"kvforge[{lowering}] ({quantize or 'fp32'}{', no spin' if args.spin is False else ''}{packed})"
        plan.append((label, sys.executable, "kvforge", kvforge_job, step_bytes))

    roofline_job = {"bytes": int(args.roofline_gib * 2**30), "threads": args.threads, "repeat": args.roofline_repeat}
    bandwidth_before = None
    if args.roofline_gib > 0:
        say(f"roofline: {args.roofline_gib:g} GiB read by {args.threads} threads")
        bandwidth_before = run_worker(sys.executable, "roofline", roofline_job, work)

    def before(name: str, job: dict[str, Any]) -> None:
        if genai_dir is not None and "genai_dir" in job:
            set_genai_threads(genai_dir, job["threads"])  # genai reads its threads from genai_config.json

    runs = [(name, python, worker, job, None) for name, python, worker, job, _ in plan]
    per_round, rows = run_rounds(runs, args.rounds, work, before)
    for name, _, _, job, step_bytes in plan:
        if name in rows:
            continue
        r = rows[name] = combine_rounds(per_round[name])
        r["threads"] = job["threads"]  # None: the library's default
        r["threads_label"] = str(job["threads"]) if job["threads"] else "def"
        r["decode_tokens_per_s"] = args.batch * 1e3 / r["decode_ms_step"]
        r["weight_bytes_per_step"] = step_bytes["bytes"]
        r["weight_bytes_per_step_detail"] = step_bytes
    if genai_dir is not None:
        set_genai_threads(genai_dir, args.threads)  # leave the cached model on the equal-threads setting

    roofline = None
    if bandwidth_before is not None:
        say("roofline again, after the sides")
        bandwidth_after = run_worker(sys.executable, "roofline", roofline_job, work)
        best = max(bandwidth_before["bytes_per_s"], bandwidth_after["bytes_per_s"])
        roofline = {
            "bytes_per_s": best,
            "before_bytes_per_s": bandwidth_before["bytes_per_s"],
            "after_bytes_per_s": bandwidth_after["bytes_per_s"],
            "buffer_bytes": bandwidth_before["bytes"],
            "threads": bandwidth_before["threads"],
            "repeat": args.roofline_repeat,
            "pass_s": {"before": bandwidth_before["pass_s"], "after": bandwidth_after["pass_s"]},
            "method": "float64 buffer of ones split in `threads` chunks, each np.sum'd by its own thread; "
            "best pass; bytes_per_s = the better of the before and after measurements",
        }
        for r in rows.values():
            if "error" not in r:
                r["roofline_ms_step"] = 1e3 * r["weight_bytes_per_step"] / best
                r["roofline_fraction"] = r["roofline_ms_step"] / r["decode_ms_step"]
    reference = next((r["tokens"] for n, r in rows.items() if n.startswith("transformers") and "tokens" in r), None)
    for r in rows.values():
        if reference is not None and "tokens" in r:
            r["agreement"] = agreement(r["tokens"], reference)

    ratios = {}
    peers = [n for n in rows if not n.startswith("kvforge") and "error" not in rows[n]]
    for ours in (n for n in rows if n.startswith("kvforge") and "error" not in rows[n]):
        for peer in peers:
            label = peer.split(" ")[0] + (" defaults" if peer.endswith(" defaults") else "")
            ratios[f"{ours} / {label}"] = {
                k: rows[ours][k] / rows[peer][k] for k in ("ttft_ms", "decode_ms_step", "rss_peak_bytes")
            }

    report = {
        "schema": "kvforge.peer_genai",
        "schema_version": 2,
        "config": {
            "shape": args.shape,
            "batch": args.batch,
            "precision": args.precision,
            "kvforge_quantize": quantize,
            "lowerings": args.lowering,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeat": args.repeat,
            "threads": args.threads,
            "peer_defaults": args.peer_defaults,
            "max_seq": args.max_seq or DEFAULT_MAX_SEQ,
            "rounds": args.rounds,
            "genai_max_length": args.prompt_len + args.new_tokens,
        },
        "model": {
            **asdict(shape),
            "weight_bytes": weight_bytes,
            "description": (
                f"random Llama {shape.layers} layers, hidden {shape.hidden}, heads {shape.heads}/{shape.kv_heads} kv, "
                f"intermediate {shape.intermediate}, vocab {shape.vocab}{', tied' if shape.tied else ''}, "
                f"fp32 checkpoint {weight_bytes / 2**20:.0f} MiB"
            ),
        },
        "artifacts": {
            **({"genai": {"dir": str(genai_dir), "bytes": dir_bytes(genai_dir)}} if genai_dir else {}),
            **{f"kvforge[{k}]": {"dir": str(v), "bytes": dir_bytes(v)} for k, v in artifacts.items()},
        },
        "build_s": builds,
        "env": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_before": loadavg_before,
            "loadavg_after": loadavg(),
            **{d: version(d) for d in ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "kvforge")},
        },
        "roofline": roofline,
        "rows": rows,
        "ratios": ratios,
        "notes": notes,
    }
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        say(f"wrote {args.json}")


if __name__ == "__main__":
    main()
