"""Stage: an artifact's ``onnx``-lowered prefill graph -> one TensorRT plan (``OUT/engine.plan``).

Input: an artifact directory compiled with ``--lowering onnx`` (``--target tensorrt`` does it).
Output: ``OUT/engine.plan``, ``OUT/timing.cache`` (kept and reused by the next build) and the
manifest's ``engines.tensorrt`` record (:class:`kvforge.graphs.manifest.EngineRecord`).

One plan, two optimization profiles. Decode is the prefill graph's ``S = 1`` case (the CPU
runtime already runs it so), so the plan is built from ``prefill.onnx`` alone and the weights sit
on the device once: profile 0 (``prefill``) takes batch ``1..max_batch`` x tokens
``1..max_prompt``, profile 1 (``decode``) batch ``1..max_batch`` x one token. The cache inputs
are at full capacity ``[B, H_kv, S_max, D]`` in both, their batch dim following ``B``. The runtime
runs the plan through two execution contexts, one per profile, both bound to the same cache.

:func:`profiles` is plain arithmetic (tested on CPU). :func:`build` needs a GPU and TensorRT
(>= 10.15) and has **not yet run on a GPU**: it is written against TensorRT's documented Python
API (``Builder``, ``OnnxParser``, ``IOptimizationProfile``, ``ITimingCache``,
``IProgressMonitor``) and is exercised by ``tests/gpu`` where one is lent.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvforge.graphs import contract, environment
from kvforge.graphs import manifest as mf

PLAN_FILE = "engine.plan"
TIMING_CACHE_FILE = "timing.cache"
SOURCE_GRAPH = "prefill"
NEXT_TOKEN_IDS = "next_token_ids"  # [B] int32: argmax of the logits, added to the network at build
MIN_TENSORRT = (10, 15)

Progress = Callable[[str], None]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """One optimization profile: each dynamic input's ``(min, opt, max)`` shapes."""

    name: str
    index: int
    shapes: dict[str, tuple[Shape, Shape, Shape]]

    def to_record(self) -> mf.EngineProfile:
        return mf.EngineProfile(self.name, self.index, {k: [list(s) for s in v] for k, v in self.shapes.items()})


def profiles(
    *, num_layers: int, num_kv_heads: int, head_dim: int, max_batch: int, max_seq: int, max_prompt: int
) -> list[Profile]:
    """The plan's two profiles, as data.

    Opt values (TensorRT times its tactics at ``opt``; every shape in ``[min, max]`` stays valid):
    prefill at batch 1 and ``max_prompt`` tokens, because a single prompt is the common case and
    the longest prompts are where prefill time goes; decode at ``max_batch`` rows, because decode
    throughput is what batching is for (each batch size also gets its own CUDA graph at run time).
    """
    if not 1 <= max_prompt <= max_seq:
        raise ValueError(f"max_prompt must lie in 1..max_seq={max_seq}, got {max_prompt}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")

    def shapes(batch: tuple[int, int, int], tokens: tuple[int, int, int]):
        b_min, b_opt, b_max = batch
        t_min, t_opt, t_max = tokens
        out: dict[str, tuple[Shape, Shape, Shape]] = {
            contract.INPUT_IDS: ((b_min, t_min), (b_opt, t_opt), (b_max, t_max)),
            contract.POSITION_IDS: ((b_min, t_min), (b_opt, t_opt), (b_max, t_max)),
            contract.WRITE_INDICES: ((b_min,), (b_opt,), (b_max,)),
            # The decode profile feeds input_lengths = 1 (the plan is the prefill graph).
            contract.INPUT_LENGTHS: ((b_min,), (b_opt,), (b_max,)),
        }
        for name in contract.past_names(num_layers):
            cache = (num_kv_heads, max_seq, head_dim)  # full capacity: [B, H_kv, S_max, D]
            out[name] = ((b_min, *cache), (b_opt, *cache), (b_max, *cache))
        return out

    return [
        Profile("prefill", 0, shapes((1, 1, max_batch), (1, max_prompt, max_prompt))),
        Profile("decode", 1, shapes((1, max_batch, max_batch), (1, 1, 1))),
    ]


def profiles_for(manifest: mf.Manifest) -> list[Profile]:
    m, limits = manifest.model, manifest.limits
    return profiles(
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_batch=limits.max_batch,
        max_seq=limits.max_seq,
        max_prompt=limits.max_prompt,
    )


def parse_version(text: str) -> tuple[int, ...]:
    """``"10.15.1.29"`` -> ``(10, 15, 1, 29)`` (non-numeric parts stop the parse)."""
    parts = []
    for piece in text.split("."):
        digits = re.match(r"\d*", piece).group()
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def check_buildable(manifest: mf.Manifest) -> None:
    """The artifact must hold the portable graph TensorRT parses."""
    if manifest.lowering != "onnx":
        raise ValueError(
            f"this artifact uses the {manifest.lowering} lowering, which TensorRT cannot parse; recompile with "
            "kvforge compile MODEL_DIR -o OUT --target tensorrt"
        )
    if manifest.quantization:
        raise ValueError("quantized (MatMulNBits) artifacts are ORT-only; recompile without --quantize for TensorRT")
    if SOURCE_GRAPH not in manifest.graphs:
        raise ValueError(f"the artifact has no {SOURCE_GRAPH} graph; recompile the model")


# ---------------------------------------------------------------- the build (GPU only; not yet run on a GPU)


def build(
    out_dir: str | Path, *, workspace_bytes: int | None = None, progress: Progress | None = None
) -> mf.EngineRecord:
    """Build (or rebuild) ``OUT/engine.plan`` on this GPU and record it in the manifest.

    Refuses (``DeviceUnavailableError``, a ``ValueError``) without CUDA or TensorRT; the memory
    plan is checked by the caller (``kvforge build``). ``workspace_bytes`` caps the builder's
    workspace pool. Not yet run on a GPU.
    """
    say = progress or (lambda _: None)
    root = Path(out_dir)
    manifest = mf.read(root, verify=True)
    check_buildable(manifest)
    gpu, trt = environment.cuda_gpu(), environment.tensorrt_module(MIN_TENSORRT)
    refusal = environment.build_refusal(gpu, trt)
    if refusal:
        raise environment.DeviceUnavailableError(refusal)
    started = time.perf_counter()
    plan_profiles = profiles_for(manifest)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    say(f"parsing {manifest.graphs[SOURCE_GRAPH].file} (TensorRT {trt.__version__})")
    if not parser.parse_from_file(str(root / manifest.graphs[SOURCE_GRAPH].file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT could not parse the graph: {errors} (kvforge inspect OUT lists what it checks)")
    _add_next_token_ids(trt, network)

    config = builder.create_builder_config()
    if manifest.dtype == "float32" and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # float32 means float32: TF32 matmuls would flip greedy tokens
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    for p in plan_profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        index = config.add_optimization_profile(profile)
        if index != p.index:
            raise RuntimeError(f"TensorRT gave profile {p.name} index {index}, expected {p.index}")
    cache_path = root / TIMING_CACHE_FILE
    if cache_path.is_file():
        say(f"reusing the timing cache {TIMING_CACHE_FILE} ({cache_path.stat().st_size} bytes)")
    timing_cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    if not config.set_timing_cache(timing_cache, ignore_mismatch=False):
        # A cache timed on another GPU or TensorRT is refused: start afresh rather than mix timings.
        say(f"{TIMING_CACHE_FILE} was made on another GPU or TensorRT version: timing from scratch")
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    config.progress_monitor = _progress_monitor(trt, say)

    say(f"building one plan with profiles {[p.name for p in plan_profiles]} on {gpu.name}")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT's builder returned no plan (see the TensorRT log above)")
    plan_bytes = bytes(serialized)
    (root / PLAN_FILE).write_bytes(plan_bytes)
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))

    engine = trt.Runtime(logger).deserialize_cuda_engine(plan_bytes)
    record = mf.EngineRecord(
        plan_file=PLAN_FILE,
        plan_sha256=mf.sha256_file(root / PLAN_FILE),
        plan_bytes=len(plan_bytes),
        source_graph=SOURCE_GRAPH,
        tensorrt_version=trt.__version__,
        gpu_name=gpu.name,
        compute_capability=gpu.compute_capability,
        profiles=[p.to_record() for p in plan_profiles],
        timing_cache_file=TIMING_CACHE_FILE,
        strongly_typed=strongly_typed,
        workspace_bytes=workspace_bytes,
        device_memory_bytes=int(engine.device_memory_size_v2),
        cache_aliased=all(
            engine.get_aliased_input_tensor(present) == past
            for past, present in zip(
                contract.past_names(manifest.model.num_layers), contract.present_names(manifest.model.num_layers)
            )
        ),
        outputs=[NEXT_TOKEN_IDS],
        built_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        build_seconds=round(time.perf_counter() - started, 1),
    )
    write_record(root, manifest, record)
    say(f"built {PLAN_FILE} ({len(plan_bytes) / 2**20:.1f} MiB) in {record.build_seconds:.1f}s")
    return record


def build_checked(out_dir: str | Path, *, gpu_memory: str | None = None, progress: Progress | None = None):
    """``kvforge build``: refuse without CUDA or TensorRT (one line, what is missing, what to run),
    refuse limits that cannot fit (naming the limit to lower), then :func:`build`. The workspace
    limit is what the budget leaves after the weights, the cache and the reserve."""
    from kvforge.compile import plan as memory_plan

    root = Path(out_dir)
    manifest = mf.read(root, verify=False)
    check_buildable(manifest)
    gpu, trt = environment.cuda_gpu(), environment.tensorrt_module(MIN_TENSORRT)
    refusal = environment.build_refusal(gpu, trt)
    if refusal:
        raise environment.DeviceUnavailableError(refusal)
    plan = memory_plan.plan_for(root, gpu_memory=gpu_memory, free_bytes=gpu.free_bytes, gpu_name=gpu.name)
    if plan.fits is False:
        raise ValueError(f"{plan.advice} (kvforge plan OUT shows the figures); then recompile with those limits")
    workspace = None
    if gpu_memory is not None:
        workspace = max(plan.budget_bytes - plan.weights_bytes - plan.kv_cache_bytes - plan.reserve_bytes, 0)
    return build(root, workspace_bytes=workspace, progress=progress)


def write_record(root: Path, manifest: mf.Manifest, record: mf.EngineRecord) -> mf.Manifest:
    """Rewrite the manifest with ``engines.tensorrt`` = ``record`` (the other fields unchanged)."""
    from dataclasses import replace

    updated = replace(manifest, engines={**manifest.engines, mf.ENGINE_KEY: record.to_dict()})
    mf.write(updated, root)
    return updated


def _add_next_token_ids(trt, network) -> None:
    """Add ``next_token_ids [B] int32`` = argmax of the logits, so greedy decoding reads back 4 bytes
    per row instead of a ``[B, V]`` row of logits (the logits stay an output, for sampling)."""
    logits = next(
        network.get_output(i) for i in range(network.num_outputs) if network.get_output(i).name == contract.LOGITS
    )
    topk = network.add_topk(logits, trt.TopKOperation.MAX, 1, 1 << 1)  # over V, of [B, V]
    shuffle = network.add_shuffle(topk.get_output(1))  # [B, 1] -> [B]
    shuffle.reshape_dims = (-1,)
    ids = shuffle.get_output(0)
    ids.name = NEXT_TOKEN_IDS
    network.mark_output(ids)


def _progress_monitor(trt, say: Progress):
    """A ``trt.IProgressMonitor`` that reports each top-level build phase through ``say``."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.steps: dict[str, int] = {}

        def phase_start(self, phase_name, parent_phase, num_steps) -> None:
            self.steps[phase_name] = num_steps
            if parent_phase is None:
                say(f"  {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step) -> bool:
            return True  # False would cancel the build

        def phase_finish(self, phase_name) -> None:
            self.steps.pop(phase_name, None)

    return Monitor()
