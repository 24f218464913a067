"""Stage: a model directory or an artifact + limits -> a GPU memory plan, before any build.

Input: a Hugging Face model directory (``config.json`` + ``*.safetensors``) or a kvforge artifact,
a dtype and the limits (``max_batch``, ``max_seq``, ``max_prompt``), and a budget (``--gpu-memory``,
else the GPU's free memory when there is one). Output: a :class:`MemoryPlan`: what the weights,
the KV cache and the activations take, the total against the budget, and, when it does not fit,
the limit to lower (:meth:`MemoryPlan.advice`). Plain arithmetic: no GPU, and no torch except for a hybrid model
directory, whose state layout is read through transformers' config class (its defaults).

The figures:

- weights: the bytes of every tensor in the target dtype (safetensors headers, read without
  the data; an artifact's ``weights.data``, or its TensorRT plan once built);
- KV cache: ``L * 2 * B * H_kv * S * D * bytes`` (:func:`kv_cache_bytes`); twice that when the
  engine does not alias the cache (two caches, alternated each step);
- model state (a hybrid family: an artifact's manifest, schema 3, or a model directory's config
  read by the family's state layout, :func:`kvforge.graphs.architectures.state_layout`): each
  state tensor's bytes per row times ``B``; the KV cache then counts only the layers that attend;
- activations: an upper estimate for a prefill of ``max_batch x max_prompt`` tokens
  (:func:`activation_bytes`), replaced by TensorRT's own figure (``device_memory_size_v2``,
  recorded in the manifest) once an engine is built;
- reserve: 512 MiB for the CUDA context and the libraries' workspaces (a rule of thumb; not
  counted when the budget is the free memory measured in a process that already holds a context).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvforge.graphs import manifest as mf
from kvforge.graphs.architectures import ARCHITECTURES, Dims, state_layout
from kvforge.graphs.contract import Layout

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
RESERVE_BYTES = 512 * 2**20
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"70GiB"`` -> 75161927680; ``"80GB"`` -> 80e9; ``"1024"`` -> 1024 bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write it like 70GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def human(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def kv_cache_bytes(
    num_layers: int, max_batch: int, num_kv_heads: int, max_seq: int, head_dim: int, itemsize: int
) -> int:
    """``L * 2 * B * H_kv * S * D * bytes``: the one cache allocation of the KV contract."""
    return num_layers * 2 * max_batch * num_kv_heads * max_seq * head_dim * itemsize


def activation_bytes(
    *,
    max_batch: int,
    max_prompt: int,
    max_seq: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    itemsize: int,
) -> int:
    """Upper estimate of the activations live at once in a prefill of ``T = B * S_p`` tokens:

    ``itemsize * (T * (4 * hidden + 2 * intermediate + (H + 2 * H_kv) * D) + B * H * S_p * S_max + B * V)``

    i.e. the residual stream, its normed copy, the attention output and the MLP input (4 hidden
    wide), the MLP's gate and up projections, the q/k/v projections, one layer's attention scores
    if attention is not fused, and the logits of each row's last token. Layers run one after
    another, so one layer's worth counts. An over-estimate for TensorRT, which fuses attention
    and reuses buffers; its own figure replaces this once an engine is built.
    """
    tokens = max_batch * max_prompt
    per_token = 4 * hidden_size + 2 * intermediate_size + (num_heads + 2 * num_kv_heads) * head_dim
    scores = max_batch * num_heads * max_prompt * max_seq
    return itemsize * (tokens * per_token + scores + max_batch * vocab_size)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its dims, its MLP width and its weight bytes in the target dtype."""

    dims: Dims
    intermediate_size: int
    weights_bytes: int
    weights_source: str  # how weights_bytes was found
    kv_layers: int | None = None  # layers that keep KV (a hybrid artifact's); None: every layer
    state_row_bytes: int = 0  # one row's state tensors (a hybrid artifact's), bytes
    kv_int8: bool = False  # an 8-bit KV artifact's (--kv-dtype int8): D int8 values + a float32 scale per row and head


@dataclass(frozen=True)
class MemoryPlan:
    source: str
    dtype: str
    max_batch: int
    max_seq: int
    max_prompt: int
    aliased: bool  # False: two caches, alternated (TensorRT reported no aliasing)
    weights_bytes: int
    weights_source: str
    kv_cache_bytes: int  # both caches when not aliased
    activation_bytes: int
    activation_source: str  # "estimate (formula in compile/plan.py)" or "TensorRT device_memory_size_v2"
    reserve_bytes: int
    budget_bytes: int | None
    budget_source: str  # "--gpu-memory", "free memory of <GPU>", or "none (no GPU, no --gpu-memory)"
    advice: str | None  # the limit to lower when it does not fit
    state_bytes: int = 0  # a hybrid model's state tensors, max_batch rows (updated in place)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.state_bytes + self.activation_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}


def model_shape_from_dir(model_dir: Path, dtype: str) -> ModelShape:
    """Dims and weight bytes of a Hugging Face model directory, from ``config.json`` and the
    safetensors headers (no tensor data is read)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"{str(model_dir)!r} is neither a kvforge artifact nor a Hugging Face model directory (no config.json)"
        )
    config = json.loads(config_path.read_text())
    try:
        dims = Dims.from_config(SimpleNamespace(**config))
    except AttributeError as e:
        raise ValueError(f"{config_path} lacks a dimension the memory plan needs ({e})") from e
    intermediate = int(config.get("intermediate_size") or 4 * dims.hidden_size)
    layout = _state_layout(model_dir, config, dtype)
    state = _state_fields(layout) if layout is not None and layout.has_state else {}
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        numel = sum(n for f in files for n in _safetensors_numels(f))
        weights = numel * ITEMSIZE[dtype]
        return ModelShape(dims, intermediate, weights, f"{len(files)} safetensors file(s) as {dtype}", **state)
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{str(model_dir)!r} has no *.safetensors or pytorch_model*.bin weights")
    source = ITEMSIZE.get(str(config.get("torch_dtype") or config.get("dtype") or "float32"), 4)
    size = sum(f.stat().st_size for f in bins)
    weights = size * ITEMSIZE[dtype] // source
    return ModelShape(dims, intermediate, weights, "pytorch_model*.bin file size, rescaled", **state)


def _state_layout(model_dir: Path, config: dict, dtype: str) -> Layout | None:
    """Which layers of a model directory keep a state, for a family whose architecture entry says
    its layers do (None otherwise): the family's state layout over transformers' config class,
    which fills what config.json leaves to its defaults."""
    architecture = (config.get("architectures") or [None])[0]
    spec = ARCHITECTURES.get(architecture)
    if spec is None or spec.state is None:
        return None
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_dir)).get_text_config(decoder=True)
    return state_layout(spec, hf_config, dtype)


def _state_fields(layout: Layout) -> dict[str, int]:
    """:class:`ModelShape`'s fields of a hybrid model: its KV layers and one row's state bytes."""
    return {"kv_layers": len(layout.attention), "state_row_bytes": layout.state_row_bytes()}


def _safetensors_numels(path: Path) -> list[int]:
    """Element counts of every tensor of a safetensors file, from its JSON header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    numels = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for d in info["shape"]:
            n *= d
        numels.append(n)
    return numels


def model_shape_from_artifact(manifest: mf.Manifest, root: Path) -> ModelShape:
    m = manifest.model
    dims = Dims(m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size, m.vocab_size)
    config = Path(manifest.source.get("path", "")) / "config.json"
    intermediate = 4 * m.hidden_size
    if config.is_file():
        intermediate = int(json.loads(config.read_text()).get("intermediate_size") or intermediate)
    engine = mf.engine_record(manifest)
    state = _state_fields(manifest.layout) if manifest.layout.has_state else {}
    if manifest.layout.quantized_kv:
        state["kv_int8"] = True
    if engine:
        return ModelShape(dims, intermediate, engine.plan_bytes, f"TensorRT plan {engine.plan_file}", **state)
    return ModelShape(
        dims, intermediate, manifest.weights.bytes, f"{manifest.weights.file} ({manifest.dtype})", **state
    )


def make_plan(
    shape: ModelShape,
    *,
    source: str,
    dtype: str,
    max_batch: int,
    max_seq: int,
    max_prompt: int | None = None,
    aliased: bool = True,
    budget_bytes: int | None = None,
    budget_source: str = "none (no GPU, no --gpu-memory)",
    engine_activation_bytes: int | None = None,
    reserve_bytes: int = RESERVE_BYTES,
) -> MemoryPlan:
    """The plan for these limits; ``advice`` names the limit to lower when it exceeds the budget."""
    max_prompt = max_seq if max_prompt is None else max_prompt
    if max_batch < 1 or max_seq < 2 or not 1 <= max_prompt <= max_seq:
        raise ValueError(
            f"limits must satisfy max_batch >= 1, max_seq >= 2, 1 <= max_prompt <= max_seq; "
            f"got {max_batch}, {max_seq}, {max_prompt}"
        )

    def need(batch: int, seq: int, prompt: int) -> tuple[int, int]:
        d, item = shape.dims, ITEMSIZE[dtype]
        layers = d.num_layers if shape.kv_layers is None else shape.kv_layers
        if shape.kv_int8:  # int8 rows and their float32 scales
            kv = kv_cache_bytes(layers, batch, d.num_kv_heads, seq, d.head_dim + 4, 1) * (1 if aliased else 2)
        else:
            kv = kv_cache_bytes(layers, batch, d.num_kv_heads, seq, d.head_dim, item) * (1 if aliased else 2)
        act = engine_activation_bytes
        if act is None:
            act = activation_bytes(
                max_batch=batch,
                max_prompt=prompt,
                max_seq=seq,
                hidden_size=d.hidden_size,
                intermediate_size=shape.intermediate_size,
                num_heads=d.num_heads,
                num_kv_heads=d.num_kv_heads,
                head_dim=d.head_dim,
                vocab_size=d.vocab_size,
                itemsize=item,
            )
        return kv + shape.state_row_bytes * batch, act

    kv, act = need(max_batch, max_seq, max_prompt)
    state = shape.state_row_bytes * max_batch
    kv -= state
    total = shape.weights_bytes + kv + state + act + reserve_bytes
    advice = None
    if budget_bytes is not None and total > budget_bytes:

        def fits(batch: int, seq: int, prompt: int) -> bool:
            return shape.weights_bytes + sum(need(batch, seq, prompt)) + reserve_bytes <= budget_bytes

        fixed = shape.weights_bytes + reserve_bytes
        advice = _advice(fits, fixed, budget_bytes, dtype, max_batch, max_seq, max_prompt)
    return MemoryPlan(
        source=source,
        dtype=dtype,
        max_batch=max_batch,
        max_seq=max_seq,
        max_prompt=max_prompt,
        aliased=aliased,
        weights_bytes=shape.weights_bytes,
        weights_source=shape.weights_source,
        kv_cache_bytes=kv,
        state_bytes=state,
        activation_bytes=act,
        activation_source="estimate (formula in compile/plan.py)"
        if engine_activation_bytes is None
        else "TensorRT device_memory_size_v2",
        reserve_bytes=reserve_bytes,
        budget_bytes=budget_bytes,
        budget_source=budget_source,
        advice=advice,
    )


def _largest(ok, hi: int, lo: int) -> int | None:
    """The largest ``v`` in ``[lo, hi]`` with ``ok(v)`` (``ok`` monotone: true below a threshold)."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _advice(fits, fixed: int, budget: int, dtype: str, batch: int, seq: int, prompt: int) -> str:
    if fixed > budget or not fits(1, 2, 1):
        # A smaller dtype only where there is one: float16 and bfloat16 are already the smallest.
        smaller = [f"--dtype {d}" for d in ("float16",) if ITEMSIZE[d] < ITEMSIZE[dtype]]
        fixes = ", ".join([*smaller, "a smaller or quantized model", "or a GPU with more memory"])
        return f"the weights and the CUDA reserve alone need {human(fixed)} of {human(budget)}: use {fixes}"
    options = []
    best_seq = _largest(lambda s: fits(batch, s, min(prompt, s)), seq, 2)
    if best_seq:
        options.append(f"--max-seq {best_seq}" + (f" (with --max-prompt {best_seq})" if prompt > best_seq else ""))
    best_batch = _largest(lambda b: fits(b, seq, prompt), batch, 1)
    if best_batch:
        options.append(f"--max-batch {best_batch}")
    best_prompt = _largest(lambda p: fits(batch, seq, p), prompt, 1)
    if best_prompt:
        options.append(f"--max-prompt {best_prompt}")
    if not options:
        options.append("--max-batch 1 with a smaller --max-seq")
    return "does not fit: lower " + " or ".join(options)


def plan_for(
    path: str | Path,
    *,
    dtype: str | None = None,
    max_batch: int | None = None,
    max_seq: int | None = None,
    max_prompt: int | None = None,
    gpu_memory: str | None = None,
    free_bytes: int | None = None,
    gpu_name: str | None = None,
    aliased: bool | None = None,
) -> MemoryPlan:
    """The plan for a model directory or an artifact. An artifact supplies its own dtype and limits
    (a given option overrides them: "what if"), its weights file or plan, and TensorRT's
    activation figure and aliasing once an engine is built. The budget is ``gpu_memory`` when
    given, else ``free_bytes`` (the caller measured it on ``gpu_name``), else none."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"{str(root)!r} does not exist; give a model directory or an artifact directory")
    engine_act = None
    if (root / mf.MANIFEST_FILE).is_file():
        manifest = mf.read(root, verify=False)
        shape = model_shape_from_artifact(manifest, root)
        if dtype is not None and dtype != manifest.dtype:
            raise ValueError(f"the artifact is {manifest.dtype}; --dtype applies to model directories only")
        dtype = manifest.dtype
        limits = manifest.limits
        # "What if" limits: TensorRT's activation figure was measured for the artifact's own only.
        pairs = ((max_batch, limits.max_batch), (max_seq, limits.max_seq), (max_prompt, limits.max_prompt))
        changed = any(given not in (None, mine) for given, mine in pairs)
        max_batch = max_batch or limits.max_batch
        max_seq = max_seq or limits.max_seq
        max_prompt = max_prompt or min(limits.max_prompt, max_seq)
        engine = mf.engine_record(manifest)
        if engine and not changed:
            engine_act = engine.device_memory_bytes
            if aliased is None and engine.cache_aliased is not None:
                aliased = engine.cache_aliased
    else:
        dtype = dtype or "float16"
        shape = model_shape_from_dir(root, dtype)
        max_batch = max_batch or 4
        max_seq = max_seq or 512
    if gpu_memory is not None:
        budget, budget_source = parse_bytes(gpu_memory), "--gpu-memory"
    elif free_bytes is not None:
        budget, budget_source = free_bytes, f"free memory of {gpu_name or 'the GPU'}"
    else:
        budget, budget_source = None, "none (no GPU here and no --gpu-memory)"
    return make_plan(
        shape,
        source=str(root),
        dtype=dtype,
        max_batch=max_batch,
        max_seq=max_seq,
        max_prompt=max_prompt,
        aliased=True if aliased is None else aliased,
        budget_bytes=budget,
        budget_source=budget_source,
        engine_activation_bytes=engine_act,
    )


def format_plan(plan: MemoryPlan) -> str:
    cache = "one cache, updated in place" if plan.aliased else "two caches, alternated each step"
    rows = [
        ("weights", plan.weights_bytes, plan.weights_source),
        ("KV cache", plan.kv_cache_bytes, f"L*2*B*H_kv*S*D*bytes, {cache}"),
        *(
            [("model state", plan.state_bytes, "B * state bytes per row (conv/recurrent layers), in place")]
            if plan.state_bytes
            else []
        ),
        ("activations", plan.activation_bytes, plan.activation_source),
        ("CUDA reserve", plan.reserve_bytes, "context and library workspaces (rule of thumb)"),
        ("total", plan.total_bytes, ""),
    ]
    lines = [
        f"memory plan for {plan.source}: {plan.dtype}, max_batch {plan.max_batch}, max_seq {plan.max_seq}, "
        f"max_prompt {plan.max_prompt}"
    ]
    lines += [f"  {name:<13}{human(n):>12}  {note}".rstrip() for name, n, note in rows]
    if plan.budget_bytes is None:
        lines.append(f"  budget: {plan.budget_source}; give --gpu-memory 70GiB to check a fit")
    else:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"  budget {human(plan.budget_bytes)} ({plan.budget_source}): {verdict}")
        if plan.advice:
            lines.append(f"  {plan.advice}")
    return "\n".join(lines)
