"""``compile_model``: a Hugging Face model directory -> a kvforge artifact directory.

Runs the stages in order (load -> transformers reference -> export ONE general graph -> shared
weights + the derived prefill/decode/score graphs -> ORT optimization of the general graph + the
derived ``.ort.onnx`` graphs -> parity -> manifest) into a temporary sibling directory and renames
it into place only when everything succeeded, so an interrupted or
failed compile never leaves a directory that loads as an artifact. Progress goes to ``progress``
(stderr by default): a line when each stage starts and one with its time when it ends.

Memory: a safetensors checkpoint of a verified family is loaded in part
(:mod:`kvforge.compile.streamed`): the traced layers, embedding, norm and lm_head; the other
layers stay in the checkpoint. The transformers reference runs on that model, loading each other
layer as it runs. After the export every weight of the graph is read from the checkpoint when the
quantizer (one MatMul at a time) or the weights file takes it, so the float model is never whole
in memory (peak RSS about the libraries plus the quantized weights; tests/compile/test_bounded_memory.py).
Otherwise the torch model lives until the export ends and the weights stream from it to
``weights.data`` one tensor at a time. The ORT optimizer and the parity session map
``weights.data`` and do not prepack.

Output layout (see docs/manifest.md)::

    OUT/prefill.onnx  OUT/decode.onnx  OUT/weights.data  OUT/manifest.json
    OUT/tokenizer.json ... OUT/generation_config.json
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

import kvforge.compile.export as export_stage
from kvforge.compile import chat_format, heap
from kvforge.compile import derive as derive_stage
from kvforge.compile import load as load_stage
from kvforge.compile import optimize as optimize_stage
from kvforge.compile import packing as packing_stage
from kvforge.compile import parity as parity_stage
from kvforge.compile import quantize as quantize_stage
from kvforge.compile import source as source_stage
from kvforge.compile import tokenizer as tokenizer_stage
from kvforge.compile.optimize import ORT_SUFFIX
from kvforge.compile.weights import SharedWeights
from kvforge.graphs import contract, lowering
from kvforge.graphs import manifest as mf
from kvforge.graphs.architectures import UnsupportedArchitectureError, supported

Progress = Callable[[str], None]
DEFAULT_MAX_SEQ = 512
GENERAL = "general"  # the one traced graph's file stem while compiling (not part of the artifact)
# --target -> (default dtype, default lowering). cpu: today's ORT CPU graphs; cuda: ORT's CUDA
# provider (GroupQueryAttention); tensorrt: the portable onnx lowering TensorRT parses.
TARGETS = {"cpu": ("float32", "gqa"), "cuda": ("float16", "gqa"), "tensorrt": ("float16", "onnx")}
CUDA_AT_LOAD = (
    "ORT's offline optimizer for the CUDA provider needs the CUDA provider itself; the CUDA session "
    "optimizes the portable graphs at load (ORT_ENABLE_ALL) instead"
)


def stderr_progress(message: str) -> None:
    print(f"[kvforge] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class CompileOptions:
    dtype: str = "float32"
    max_batch: int = 4
    max_seq: int | None = DEFAULT_MAX_SEQ  # None: min(DEFAULT_MAX_SEQ, the model's max positions)
    lowering: str = "gqa"
    score_graph: bool = True
    quantize: str | None = None  # "int4" | "int8": MatMul weights as MatMulNBits (ORT only)
    block_size: int = quantize_stage.DEFAULT_BLOCK_SIZE
    optimize: bool = True  # also write ORT-optimized <graph>.ort.onnx
    target: str = "cpu"  # "cpu" | "cuda" | "tensorrt" (TARGETS)
    max_prompt: int | None = None  # longest prompt (TensorRT's prefill profile); None: max_seq
    trust_remote_code: bool = False  # run the modeling code config.json's auto_map names
    full_trace: bool = False  # trace every layer, never copy one (debugging: kvforge.compile.replicate)
    pack_tied_lm_head: bool = True  # ORT graphs: the tied lm_head packed by ORT (False: read in place, slower)
    symmetric: bool = True  # quantize: symmetric blocks (False: a zero point per block)
    quantize_lm_head: bool = True  # quantize: the lm_head too (False: it stays in the model's dtype)
    lm_head: str | None = None  # quantize: "int4" | "int8" | "float"; None: the scheme's (quantize.DEFAULT_LM_HEAD)
    lm_head_block_size: int | None = None  # quantize: the lm_head's blocks; None: quantize.lm_head_blocks' rule
    kv_dtype: str = "float"  # contract.KV_DTYPES: "int8" = 8-bit KV rows with a float32 scale each

    def lm_head_precision(self) -> str:
        """--quantize's lm_head: "int4" | "int8" | "float" (--no-quantize-lm-head: "float")."""
        return quantize_stage.lm_head_precision(self.quantize, "float" if not self.quantize_lm_head else self.lm_head)

    def check(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if self.target == "tensorrt" and self.lowering != "onnx":
            raise ValueError(
                f"--target tensorrt needs the onnx lowering (TensorRT cannot parse {self.lowering}); drop --lowering"
            )
        if self.target == "tensorrt" and self.quantize:
            raise ValueError(
                "--quantize makes MatMulNBits graphs, which only ONNX Runtime runs; not with --target tensorrt"
            )
        if self.max_prompt is not None and not 1 <= self.max_prompt <= (self.max_seq or self.max_prompt):
            raise ValueError(f"max_prompt must lie in 1..max_seq={self.max_seq}, got {self.max_prompt}")
        if self.dtype not in load_stage.DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(load_stage.DTYPES)}")
        if self.lowering not in lowering.LOWERINGS:
            raise ValueError(f"unknown lowering {self.lowering!r}; choose one of {', '.join(lowering.LOWERINGS)}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.max_seq is not None and self.max_seq < 2:
            raise ValueError(f"max_seq must be at least 2 (one prompt token, one generated), got {self.max_seq}")
        if self.quantize is not None and self.quantize not in quantize_stage.QUANTIZE_BITS:
            raise ValueError(
                f"unknown quantization {self.quantize!r}; choose one of {', '.join(quantize_stage.QUANTIZE_BITS)}"
            )
        if self.lm_head is not None:
            quantize_stage.check_lm_head(self.lm_head, self.quantize, self.quantize_lm_head)
        if self.lm_head_block_size is not None:
            head = self.lm_head_precision() if self.quantize else None
            quantize_stage.check_lm_head_block_size(self.lm_head_block_size, self.quantize, head)
        self._check_kv_dtype()

    def _check_kv_dtype(self) -> None:
        if self.kv_dtype not in contract.KV_DTYPES:
            raise ValueError(f"unknown KV dtype {self.kv_dtype!r}; choose one of {', '.join(contract.KV_DTYPES)}")
        if self.kv_dtype == "float":
            return
        if self.target != "cpu":
            raise ValueError(
                f"--kv-dtype int8 runs on ONNX Runtime's CPU provider only, not --target {self.target} "
                "(the GPU backends bind a float cache); compile for --target cpu, or keep --kv-dtype float"
            )
        if self.lowering == "gqa":
            raise ValueError(
                "--kv-dtype int8 cannot use --lowering gqa: ONNX Runtime's GroupQueryAttention takes a float "
                "cache only; use --lowering onnx (the default with int8) or exact"
            )


class OutputDirError(ValueError):
    pass


def _check_out_dir(out: Path) -> None:
    """Refuse to replace a directory that is not a kvforge artifact: it may hold the user's files."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / mf.MANIFEST_FILE).exists())):
        raise OutputDirError(
            f"output {str(out)!r} exists and is not a kvforge artifact; choose another -o or remove it"
        )


def compile_model(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_batch: int = 4,
    max_seq: int | None = None,
    lowering: str | None = None,
    score_graph: bool = True,
    quantize: str | None = None,
    block_size: int = quantize_stage.DEFAULT_BLOCK_SIZE,
    optimize: bool = True,
    target: str = "cpu",
    max_prompt: int | None = None,
    gpu_memory: str | None = None,
    trust_remote_code: bool = False,
    full_trace: bool = False,
    pack_tied_lm_head: bool = True,
    revision: str | None = None,
    symmetric: bool = True,
    quantize_lm_head: bool = True,
    lm_head: str | None = None,
    lm_head_block_size: int | None = None,
    kv_dtype: str = "float",
    progress: Progress | None = stderr_progress,
) -> mf.Manifest:
    """Compile ``model_dir`` into ``out_dir``; returns the manifest written there.

    ``model_dir`` is a Hugging Face model directory, a ``.gguf`` file (converted by transformers'
    GGUF reader; its Q4_0, Q8_0 and Q4_1 blocks are kept as they are, :mod:`kvforge.compile.gguf_exact`)
    or a Hub id ``ORG/NAME`` that is not a local path (config, tokenizer and safetensors from the
    Hub or its local cache, at ``revision``; :mod:`kvforge.compile.source`).

    Raises :class:`kvforge.compile.load.ModelDirError` for a missing or non-HF directory,
    :class:`kvforge.graphs.architectures.UnsupportedArchitectureError` (listing what is supported),
    ``ValueError`` for bad options. ``max_seq`` defaults to 512, or the model's
    ``max_position_embeddings`` if that is smaller. ``score_graph`` adds ``score.onnx`` (logits of
    every position, for perplexity and comparisons; it shares the weights file). ``quantize``
    ("int4" | "int8", blocks of ``block_size``) makes MatMul weights ``MatMulNBits`` (ORT only),
    with symmetric blocks unless ``symmetric=False`` (a zero point per block), the lm_head included
    unless ``quantize_lm_head=False``; ``lm_head`` ("int4" | "int8" | "float") gives the lm_head its
    own precision (default int8, under int4 too: quantize.DEFAULT_LM_HEAD; docs/performance.md measures each),
    in blocks of ``lm_head_block_size`` (None: 128 where that divides its input width, else ``block_size``:
    quantize.lm_head_blocks).
    ``kv_dtype`` "int8" keeps the KV cache in 8 bits (a float32 scale per cached row and head,
    :mod:`kvforge.graphs.contract`; CPU target, ``onnx`` or ``exact`` lowering, ``onnx`` by default;
    not for families whose layers keep a state); "float" (default) keeps it in ``dtype``.
    ``optimize`` also writes ONNX Runtime-optimized ``<graph>.ort.onnx`` graphs (CPU target only).
    ``target`` ("cpu" | "cuda" | "tensorrt") sets the defaults of ``dtype`` and ``lowering``
    (:data:`TARGETS`); "tensorrt" also builds the engine at once when this machine has a GPU
    and TensorRT (``gpu_memory`` caps the build), else says to run ``kvforge build OUT`` on the
    target GPU. ``max_prompt`` (default ``max_seq``) bounds TensorRT's prefill profile.
    ``trust_remote_code`` lets a family that needs its own modeling code (config.json's
    ``auto_map``, a model type transformers does not ship) run it; without it such a directory is
    refused before anything is loaded. ``full_trace`` traces every decoder layer instead of
    copying a traced one (:mod:`kvforge.compile.replicate`; for debugging: the graphs are the same).
    ``pack_tied_lm_head`` (default): in the ORT graphs, a lm_head tied to the embedding table reads
    views of the table that ONNX Runtime packs at load (the lm_head Gemm at batch 4 on the
    SmolLM-135M shape: 3.2 ms per step, against 6.0 ms reading the table unpacked), while the
    embedding lookup reads only the rows it needs (:mod:`kvforge.runtime.embedding_rows`), so the
    table is held about once; False: the lm_head reads the table in place, unpacked (no packed copy:
    the least memory, a slower step; benchmarks/README.md). Nothing is written to ``out_dir`` unless
    compile succeeds.
    """
    _check_types(
        model_dir,
        out_dir,
        max_batch,
        max_seq,
        max_prompt,
        block_size,
        dict(
            score_graph=score_graph,
            optimize=optimize,
            trust_remote_code=trust_remote_code,
            full_trace=full_trace,
            pack_tied_lm_head=pack_tied_lm_head,
            symmetric=symmetric,
            quantize_lm_head=quantize_lm_head,
        ),
    )
    # numpy ints are accepted; the manifest (JSON) holds Python ints
    max_batch, block_size = int(max_batch), int(block_size)
    max_seq = None if max_seq is None else int(max_seq)
    max_prompt = None if max_prompt is None else int(max_prompt)
    say = progress or (lambda _: None)
    out = Path(out_dir)
    _check_out_dir(out)
    scratch = out.parent / f".{out.name}.source-kvforge"  # a GGUF file's conversion, removed after
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if lowering is None and kv_dtype == "int8" and TARGETS[target][1] == "gqa":
        lowering = "onnx"  # GroupQueryAttention takes a float cache only: the standard-op lowering
        say("--kv-dtype int8: lowering onnx (GroupQueryAttention takes a float cache only)")
    options = CompileOptions(
        dtype=dtype or TARGETS[target][0],
        max_batch=max_batch,
        max_seq=max_seq,
        lowering=lowering or TARGETS[target][1],
        score_graph=score_graph,
        quantize=quantize,
        block_size=block_size,
        optimize=optimize and target == "cpu",  # the .ort.onnx graphs are optimized for ORT's CPU provider
        target=target,
        max_prompt=max_prompt,
        trust_remote_code=trust_remote_code,
        full_trace=full_trace,
        pack_tied_lm_head=pack_tied_lm_head,
        symmetric=symmetric,
        quantize_lm_head=quantize_lm_head,
        lm_head=lm_head,
        lm_head_block_size=None if lm_head_block_size is None else int(lm_head_block_size),
        kv_dtype=kv_dtype,
    )
    options.check()  # before a Hub download or a GGUF conversion
    with source_stage.resolve(model_dir, revision, scratch, say) as source:
        return _compile_source(source, out, options, gpu_memory, say)


def _compile_source(
    source: source_stage.Source, out: Path, options: CompileOptions, gpu_memory: str | None, say: Progress
) -> mf.Manifest:
    """:func:`compile_model` on a resolved source (a Hugging Face directory); ``options.max_seq``
    None is resolved from the model's config here."""
    model_dir = source.model_dir
    config, weight_files = load_stage.read_config(model_dir)  # fail fast, before any heavy work
    spec = load_stage.resolve_spec(config, model_dir, options.trust_remote_code)
    if not spec.verified:
        say(
            f"{spec.architecture} is not in kvforge's verified table: taking the generic path; "
            "the parity check against transformers decides"
        )
    max_positions = config.get("max_position_embeddings") or config.get("n_positions")
    if options.max_seq is None:
        options = dataclasses.replace(options, max_seq=min(DEFAULT_MAX_SEQ, max_positions or DEFAULT_MAX_SEQ))
    elif max_positions and options.max_seq > max_positions:
        raise ValueError(
            f"max_seq={options.max_seq} exceeds the model's max_position_embeddings={max_positions}; "
            f"use --max-seq {max_positions} or less"
        )
    options.check()
    _check_out_dir(out)

    started = time.perf_counter()
    tmp = out.parent / f".{out.name}.tmp-kvforge"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # The checkpoint's sha256 (the manifest's source record) is read and hashed on a thread of
        # its own while the stages run: hashlib and file reads release the GIL.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-hash") as pool:
            source_hashes = pool.submit(lambda: {f.name: mf.sha256_file(f) for f in weight_files})
            try:
                manifest = _compile_into(source, tmp, options, config, weight_files, say, started, source_hashes)
            finally:
                heap.unfreeze()
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"done in {time.perf_counter() - started:.1f}s -> {out}")
    if options.target == "tensorrt":
        manifest = _build_if_possible(out, manifest, gpu_memory, say)
    return manifest


class OptionTypeError(TypeError, ValueError):
    """A compile_model argument of the wrong type (a ValueError too: the CLI prints it as one line).
    The same rule as :mod:`kvforge.runtime.validate`, which compile does not import."""


def _refuse_type(name: str, value: object, accepted: str) -> OptionTypeError:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return OptionTypeError(f"{name}={text} is not accepted: {name} must be {accepted}")


def _check_types(model_dir, out_dir, max_batch, max_seq, max_prompt, block_size, flags: dict[str, object]) -> None:
    """compile_model's arguments by type, before any file is read: paths are str/PathLike, counts
    Python or numpy ints (``max_batch=2.5`` refused, not truncated), flags bools. Their ranges are
    :meth:`CompileOptions.check`'s."""
    for name, value, what in (
        ("model_dir", model_dir, "a Hugging Face model directory"),
        ("out_dir", out_dir, "the artifact directory to write"),
    ):
        if not isinstance(value, (str, os.PathLike)):
            raise _refuse_type(name, value, f"a str or a path: {what}")
    counts = {"max_batch": max_batch, "max_seq": max_seq, "max_prompt": max_prompt, "block_size": block_size}
    for name, value in counts.items():
        if value is None and name in ("max_seq", "max_prompt"):
            continue
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
            raise _refuse_type(name, value, "an integer (int or numpy integer; bools and floats are refused)")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise _refuse_type(name, value, "True or False")


def _build_if_possible(out: Path, manifest: mf.Manifest, gpu_memory: str | None, say: Progress) -> mf.Manifest:
    """Build the TensorRT engine now when this machine can; else say where to build it."""
    from kvforge.compile import tensorrt as tensorrt_stage
    from kvforge.graphs import environment

    refusal = environment.build_refusal(environment.cuda_gpu(), environment.tensorrt_module())
    if refusal:
        say(f"engines not built ({refusal.removeprefix('cannot build TensorRT engines here: ')})")
        return manifest
    tensorrt_stage.build_checked(out, gpu_memory=gpu_memory, progress=say)
    return mf.read(out, verify=False)


class _Stages:
    """Progress lines: ``[i/N  t s] what`` when a stage starts (t: seconds since compile began) and
    ``[i/N  t s] <stage> took x s (details)`` when it ends, so every stage's time is in the log."""

    def __init__(self, say: Progress, started: float, total: int) -> None:
        self.say, self.started, self.total = say, started, total
        self.index, self.name, self.stage_started = 0, "", started

    def start(self, name: str, text: str) -> None:
        self.end()
        self.index, self.name, self.stage_started = self.index + 1, name, time.perf_counter()
        self.say(f"[{self.index}/{self.total} {self.stage_started - self.started:6.1f}s] {text}")

    def end(self, details: str = "") -> None:
        if not self.name:
            return
        now = time.perf_counter()
        suffix = f" ({details})" if details else ""
        took = now - self.stage_started
        self.say(f"[{self.index}/{self.total} {now - self.started:6.1f}s] {self.name} took {took:.1f}s{suffix}")
        self.name = ""


def _compile_into(
    source: source_stage.Source,
    tmp: Path,
    options: CompileOptions,
    config: dict,
    weight_files: list[Path],
    say: Progress,
    started: float,
    source_hashes: concurrent.futures.Future,
) -> mf.Manifest:
    # ORT's CPU provider has no bfloat16 kernels, so it cannot optimize (or run) such graphs.
    optimize = options.optimize and options.dtype != "bfloat16"
    torch_dtype = load_stage.DTYPES[options.dtype]
    model_dir = source.model_dir
    stages = _Stages(say, started, 6 + optimize + bool(options.quantize) + bool(source.gguf))
    names = [g for g in contract.GRAPHS if g != "score" or options.score_graph]

    heap.freeze_survivors()  # the libraries imported so far: loading's collections skip them
    heap.map_large_allocations()  # freed weights go back to the system (bounded peak RSS)
    stages.start("load", f"loading {model_dir} ({options.dtype})")
    # 8-bit KV traces every layer (kvforge.compile.export), so every layer is loaded
    stream = not options.full_trace and source.gguf is None and options.kv_dtype == "float"
    loaded = load_stage.load_model(model_dir, options.dtype, options.trust_remote_code, options.max_seq, stream)
    if options.kv_dtype != "float":
        loaded = _with_kv_dtype(loaded, options.kv_dtype)
    dims, loaded_spec, layout = loaded.dims, loaded.spec, loaded.state_layout
    model_bytes = load_stage.tensor_bytes(loaded.model)  # what each collection below can give back
    if loaded.streamed is not None:
        say(
            f"layers {loaded.streamed.keep}..{loaded.streamed.total - 1} stay in the checkpoint: read one "
            "tensor at a time (bounded memory)"
        )
    stages.start("reference", "running transformers (eager) on the parity prompt, on the loaded model")
    reference = _reference(model_dir, loaded, options.dtype, options.trust_remote_code)
    heap.freeze_survivors()  # the libraries and the model: the trace's collections skip them
    try:
        stages.start(
            "export",
            f"exporting the model once ({dims.num_layers} layers, lowering {options.lowering}): one general "
            f"graph, from which the {', '.join(names)} graphs are derived",
        )
        times = export_stage.ExportTimes()
        try:
            general = export_stage.export_general(
                loaded, options.lowering, options.max_batch, options.max_seq, times, options.full_trace
            )
        except export_stage.StreamedLayersError as e:
            say(f"{e}: loading the whole model")
            del loaded
            heap.unfreeze()
            heap.collect(model_bytes)
            loaded = load_stage.load_model(model_dir, options.dtype, options.trust_remote_code, options.max_seq)
            if options.kv_dtype != "float":
                loaded = _with_kv_dtype(loaded, options.kv_dtype)
            times = export_stage.ExportTimes()
            general = export_stage.export_general(
                loaded, options.lowering, options.max_batch, options.max_seq, times, options.full_trace
            )
    except Exception as e:
        if loaded_spec.verified:
            raise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UnsupportedArchitectureError(
            f"{loaded_spec.architecture} took the generic path and could not be exported "
            f"({type(e).__name__}: {first_line}); kvforge verifies: {supported()}"
        ) from e
    # The torch model goes now: the graph holds views of the parameters it needs, released one by
    # one as the weights file takes them; or, streamed, reads them from the checkpoint instead.
    if loaded.streamed is not None:
        loaded.streamed.rebind(general, loaded.model)
    del loaded
    heap.unfreeze()  # the model's cycles must be collectable again
    heap.collect(model_bytes)
    kept = _keep_gguf_blocks(source, general, options, stages, str(times))  # before packing: it packs its own
    packing_stage.pack_projections({GENERAL: general})  # q/k/v and gate/up: one MatMul each, stored packed
    if options.quantize:
        stages.end(str(times))
        width = quantize_stage.lm_head_width(general)  # None: no lm_head to quantize (a GGUF's kept blocks)
        if options.lm_head_precision() != "float" and width is not None:  # the blocks the manifest records
            blocks = quantize_stage.lm_head_blocks(options.block_size, options.lm_head_block_size, width)
            options = dataclasses.replace(options, lm_head_block_size=blocks)
        head = f", the lm_head's {options.lm_head_block_size}" if options.lm_head_block_size else ""
        blocks_said = f"blocks of {options.block_size}{head}"
        stages.start("quantize", f"quantizing MatMul weights to {options.quantize} ({blocks_said})")
        exclude = kept.exclude if kept else []
        general = quantize_stage.quantize(
            {GENERAL: general},
            options.quantize,
            options.block_size,
            exclude,
            symmetric=options.symmetric,
            lm_head=options.lm_head_precision(),
            lm_head_block_size=options.lm_head_block_size,
        )[GENERAL]
        stages.start("write", "writing one shared weights file and deriving the graphs")
    else:
        stages.end(str(times))
        stages.start("write", "writing one shared weights file and deriving the graphs")
    if options.lowering == "exact":  # int4/int8 blocks (quantized or a GGUF's): one-token steps take the verify kernel
        quantize_stage.never_one_row(general)
    weights = SharedWeights(tmp)
    weights.externalize(general)
    heap.collect(model_bytes)
    heap.trim()
    heap.freeze_survivors()  # the torch model and the weights are gone: later collections skip the rest
    for name in names:
        weights.save(derive_stage.derive(general, name), name)
    weights.save(general, GENERAL)  # the optimizer's input; not part of the artifact
    del general
    optimized = {}
    if optimize:
        stages.start("optimize", "optimizing for ONNX Runtime once (fusions, offline optimizer), then deriving")
        optimize_times: dict[str, float] = {}
        [general_file] = optimize_stage.optimize_graphs(
            tmp,
            [GENERAL],
            weights,
            optimize_times,
            max_positions=options.max_seq,
            pack_tied_lm_head=options.pack_tied_lm_head,
        ).values()
        started_derive = time.perf_counter()
        general_ort = ir.load(tmp / general_file)
        for name in names:
            optimized[name] = weights.save(derive_stage.derive(general_ort, name), name + ORT_SUFFIX).name
        del general_ort
        optimize_times["derived"] = time.perf_counter() - started_derive
        stages.end(", ".join(f"{step} {seconds:.1f}s" for step, seconds in optimize_times.items()))
    for leftover in tmp.glob(f"{GENERAL}*"):
        leftover.unlink()
    tok = tokenizer_stage.copy_tokenizer(model_dir, tmp, config)
    stages.start("parity", "checking parity against transformers")
    run_file = optimized.get("prefill", "prefill.onnx")  # what the runtime runs
    parity = parity_stage.measure(tmp, run_file, reference, dims, torch_dtype, layout)
    quantized = options.quantize or options.kv_dtype != "float"  # parity then measures the quantization too
    if not loaded_spec.verified and not quantized and not (kept and kept.nodes):
        problem = parity_stage.failure(parity, options.dtype)
        if problem:
            raise UnsupportedArchitectureError(
                f"{loaded_spec.architecture} took the generic path and failed its parity check ({problem}); "
                f"kvforge verifies: {supported()}"
            )
    parity["verified_family"] = loaded_spec.verified
    stages.start("manifest", "writing manifest")
    report = weights.report()
    files = {"source": source_hashes.result(), report.file: weights.sha256()}
    manifest = _manifest(source, tmp, options, config, files, dims, report.file, tok, parity, optimized, kept, layout)
    mf.write(manifest, tmp)
    stages.end()
    return manifest


def _with_kv_dtype(loaded: load_stage.LoadedModel, kv_dtype: str) -> load_stage.LoadedModel:
    """``loaded`` with its layout's KV in ``kv_dtype``; refused for a family with state layers
    (their states stay float, and their KV path has no 8-bit variant yet)."""
    layout = loaded.state_layout
    if layout.has_state:
        kinds = "/".join(sorted({e.kind for e in layout.states}))
        raise ValueError(
            f"--kv-dtype {kv_dtype} is not available for {loaded.spec.architecture}: its layers "
            f"{[e.layer for e in layout.states]} keep a {kinds} state beside the KV cache, and the 8-bit KV "
            "covers models whose every layer attends; compile it with --kv-dtype float"
        )
    return dataclasses.replace(loaded, layout=dataclasses.replace(layout, kv_dtype=kv_dtype))


def _keep_gguf_blocks(
    source: source_stage.Source, general: ir.Model, options: CompileOptions, stages: _Stages, export_details: str
):
    """A GGUF source: its Q4_0/Q8_0/Q4_1 projections onto their own blocks (:mod:`kvforge.compile.gguf_exact`);
    returns the pass's report, or None (not a GGUF source, or not float32: nothing rewritten)."""
    if source.gguf is None:
        return None
    from kvforge.compile import gguf, gguf_exact

    stages.end(export_details)
    if options.dtype != "float32":
        stages.start(
            "gguf", f"GGUF blocks are kept in float32 graphs only: {options.dtype} reads all weights as floats"
        )
        return None
    stages.start("gguf", f"keeping the Q4_0/Q8_0/Q4_1 blocks of {source.gguf.name} (MatMulNBits, no requantization)")
    report = gguf_exact.keep_gguf_blocks(general, gguf.GGUFBlocks(source.gguf))
    stages.end(report.summary())
    return report


def _reference(
    model_dir: Path, loaded: load_stage.LoadedModel, dtype: str, trust_remote_code: bool
) -> parity_stage.Reference | None:
    """transformers' side of the parity check, on the loaded model itself when its attention can be
    switched to eager in place, else on a second instance loaded for it and dropped at once. None
    where ORT's CPU provider cannot run the graphs (bfloat16): parity is then skipped."""
    if not parity_stage.ort_dtype_ok(load_stage.DTYPES[dtype]):
        return None
    streamed = loaded.streamed.materialized(loaded.model) if loaded.streamed else contextlib.nullcontext()
    try:
        with (
            streamed,
            parity_stage.as_transformers_eager(loaded.model, bool(loaded.spec.experts_implementation)) as model,
        ):
            return parity_stage.reference(model, loaded.dims)
    except parity_stage.ReferenceSwitchError:
        pass
    separate = load_stage.load_reference(model_dir, dtype, trust_remote_code=trust_remote_code)
    dropped = load_stage.tensor_bytes(separate)
    try:
        return parity_stage.reference(separate, loaded.dims)
    finally:
        del separate
        heap.collect(dropped)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished artifact into place; an older artifact at ``out`` is replaced."""
    if out.exists():
        old = out.parent / f".{out.name}.old-kvforge"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _io(path: Path) -> tuple[list[mf.TensorSpec], list[mf.TensorSpec]]:
    model = onnx.load(str(path), load_external_data=False)

    def spec(value: onnx.ValueInfoProto) -> mf.TensorSpec:
        t = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        if t.elem_type == onnx.TensorProto.BFLOAT16:
            dtype = "bfloat16"
        shape = [d.dim_param or d.dim_value for d in t.shape.dim]
        return mf.TensorSpec(value.name, dtype, shape)

    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]


def _manifest(
    source: source_stage.Source,
    tmp: Path,
    options: CompileOptions,
    config: dict,
    hashes: dict,
    dims,
    weights_file: str,
    tok: dict,
    parity: dict,
    optimized: dict[str, str],
    kept,
    layout: contract.Layout,
) -> mf.Manifest:
    import onnxruntime
    import torch
    import transformers

    graphs = {}
    for name in [g for g in contract.GRAPHS if (tmp / f"{g}.onnx").exists()]:
        inputs, outputs = _io(tmp / f"{name}.onnx")
        ort_file = optimized.get(name)
        graphs[name] = mf.GraphFile(
            f"{name}.onnx",
            mf.sha256_file(tmp / f"{name}.onnx"),
            inputs,
            outputs,
            ort_file=ort_file,
            ort_sha256=mf.sha256_file(tmp / ort_file) if ort_file else None,
        )
    attention = len(layout.attention)  # KV only for the layers that attend
    shape = contract.cache_shape(attention, options.max_batch, dims.num_kv_heads, options.max_seq, dims.head_dim)
    itemsize = 1 if layout.quantized_kv else load_stage.DTYPES[options.dtype].itemsize
    numel = 1
    for d in shape:
        numel *= d
    kv_cache = {
        "layout": "[layers, 2 (key, value), max_batch, kv_heads, max_seq, head_dim]",
        "shape": list(shape),
        "dtype": "int8" if layout.quantized_kv else options.dtype,
        "bytes": numel * itemsize,
        **({"layers": list(layout.attention)} if layout.has_state else {}),
    }
    if layout.quantized_kv:  # a float32 scale per cached row and head, beside the KV (schema 4)
        scales = contract.scale_shape(attention, options.max_batch, dims.num_kv_heads, options.max_seq)
        kv_cache["scale_shape"] = list(scales)
        kv_cache["scale_dtype"] = contract.KV_SCALE_DTYPE
        kv_cache["bytes"] += (numel // dims.head_dim) * 4
    tool_parser, reasoning_parser = chat_format.detect_artifact(tmp)  # from the copied tokenizer files
    return mf.Manifest(
        schema_version=mf.KV_INT8_SCHEMA if layout.quantized_kv else mf.SCHEMA_VERSION,
        kvforge_version=mf.kvforge_version(),
        created_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        source={
            "path": str((source.gguf or source.model_dir).resolve()),
            "config_sha256": mf.sha256_file(source.model_dir / "config.json"),
            "weights": hashes["source"],
            **({"trust_remote_code": True} if options.trust_remote_code else {}),
            **source.record,
        },
        model=mf.ModelDims(
            architecture=load_stage.architecture_of(config),
            model_type=config.get("model_type", ""),
            num_layers=dims.num_layers,
            num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            hidden_size=dims.hidden_size,
            vocab_size=dims.vocab_size,
        ),
        dtype=options.dtype,
        limits=mf.Limits(options.max_batch, options.max_seq, options.max_prompt or options.max_seq),
        lowering=options.lowering,
        kv_cache=kv_cache,
        state=[entry.to_dict() for entry in layout.states],
        graphs=graphs,
        weights=mf.FileRef(weights_file, hashes[weights_file], (tmp / weights_file).stat().st_size),
        tokenizer=tok,
        generation={"eos_token_ids": tok["eos_token_ids"]},
        versions={
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
            "opset": str(export_stage.OPSET),
        },
        parity=parity,
        quantization=_quantization(options, source, kept),
        ort_optimization=_ort_optimization(options, optimized),
        target=options.target,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )


def _quantization(options: CompileOptions, source: source_stage.Source, kept) -> dict | None:
    record = None
    if options.quantize:
        record = {
            "scheme": options.quantize,
            "block_size": options.block_size,
            "op": "com.microsoft.MatMulNBits",
            "symmetric": options.symmetric,
            "accuracy_level": 4,
            "lm_head": options.dtype if options.lm_head_precision() == "float" else options.lm_head_precision(),
            "embedding": options.dtype,
        }
        if options.lm_head_block_size is not None:
            record["lm_head_block_size"] = options.lm_head_block_size
    if kept and kept.nodes:
        record = record or {"scheme": "gguf", "op": "com.microsoft.MatMulNBits", "embedding": options.dtype}
        record["gguf"] = kept.record(source.gguf.name)
    return record


def _ort_optimization(options: CompileOptions, optimized: dict[str, str]) -> dict | None:
    if optimized:
        return {"optimized_for": optimize_stage.OPTIMIZED_FOR, "level": "ORT_ENABLE_EXTENDED", "fusions": "onnxscript"}
    if options.target == "cuda":
        return {
            "optimized_for": "CUDAExecutionProvider",
            "level": "ORT_ENABLE_ALL",
            "offline": False,
            "why": CUDA_AT_LOAD,
        }
    return None
