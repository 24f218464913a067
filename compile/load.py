"""Stage 1: a Hugging Face model directory -> a transformers model ready for export.

Input: a directory with ``config.json`` and ``*.safetensors`` (or ``pytorch_model*.bin``) weights.
Output: :class:`LoadedModel`: the ``*ForCausalLM`` in eval mode with kvforge's attention function,
its architecture entry and dimensions. Every problem with the directory is a :class:`ModelDirError`
that says what is missing and what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvforge.compile import generic, quiet
from kvforge.graphs import lowering, mamba
from kvforge.graphs.architectures import ArchSpec, Dims, UnsupportedArchitectureError, lookup, state_layout, supported
from kvforge.graphs.contract import Layout

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class ModelDirError(ValueError):
    """The model directory cannot be compiled (missing, not a Hugging Face model, ...)."""


@dataclass
class LoadedModel:
    model: torch.nn.Module  # *ForCausalLM, eval mode, attn_implementation="kvforge"
    spec: ArchSpec
    dims: Dims
    config: dict  # config.json as written by the model's authors
    weight_files: list[Path]
    layout: Layout | None = None  # which layers attend and which keep a state; None: every layer attends

    @property
    def state_layout(self) -> Layout:
        return self.layout if self.layout is not None else Layout.all_attention(self.dims.num_layers)

    # layers whose weights stay in the checkpoint (kvforge.compile.streamed); None: all in memory
    streamed: Any = None


def tensor_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers at their dtypes, counting those on the meta
    device (a streamed layer's) as if loaded: what dropping the model can give back, at most."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def read_config(model_dir: str | Path) -> tuple[dict, list[Path]]:
    """``config.json`` and the weight files of a model directory, or a :class:`ModelDirError`."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelDirError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelDirError(f"{str(path)!r} is not a directory; pass a Hugging Face model directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelDirError(
            f"{str(path)!r} has no config.json: it is not a Hugging Face model directory "
            "(expected config.json and *.safetensors, as written by save_pretrained)"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{config_path} is not valid JSON: {e}") from e
    weights = sorted(f for pattern in WEIGHT_PATTERNS for f in path.glob(pattern))
    if not weights:
        raise ModelDirError(f"{str(path)!r} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")
    return config, weights


def architecture_of(config: dict) -> str | None:
    archs = config.get("architectures") or []
    return archs[0] if archs else None


def needs_remote_code(config: dict) -> bool:
    """True when ``config.json`` names modeling code of its own (``auto_map``) for a model type
    transformers does not ship: only that code can build the model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    auto_map = config.get("auto_map") or {}
    return bool(auto_map) and config.get("model_type") not in CONFIG_MAPPING_NAMES


def _remote_refusal(config: dict, model_dir: str | Path | None) -> str:
    auto_map = config.get("auto_map") or {}
    code = auto_map.get("AutoModelForCausalLM") or next(iter(auto_map.values()), "")
    where = f" in {str(model_dir)!r}" if model_dir is not None else ""
    return (
        f"model type {config.get('model_type')!r} needs remote code: config.json's auto_map names "
        f"{code!r}{where}, Python that compile would run; pass --trust-remote-code "
        "(trust_remote_code=True) if you trust it"
    )


def _model_class(config: dict, model_dir: str | Path | None, trust_remote_code: bool):
    """The ``*ForCausalLM`` class of ``config``: transformers' own, or (``trust_remote_code``) the one
    that config.json's ``auto_map`` names; ``None`` when neither exists."""
    import transformers

    if not needs_remote_code(config):
        return getattr(transformers, architecture_of(config) or "", None)
    if not trust_remote_code:
        raise UnsupportedArchitectureError(_remote_refusal(config, model_dir))
    reference = (config.get("auto_map") or {}).get("AutoModelForCausalLM")
    if not reference or model_dir is None:
        raise UnsupportedArchitectureError(
            f"config.json's auto_map names no AutoModelForCausalLM class (it has "
            f"{sorted(config.get('auto_map') or {})}); kvforge compiles causal LMs only"
        )
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(reference, str(model_dir))


def resolve_spec(config: dict, model_dir: str | Path | None = None, trust_remote_code: bool = False) -> ArchSpec:
    """The architecture entry, or the generic (unverified) spec for a decoder-only causal LM whose
    transformers modules dispatch attention through ``AttentionInterface`` (read from the family's
    modeling source, :mod:`kvforge.compile.generic`); otherwise an error that names what is missing
    and lists the verified families. A family that needs remote code (see :func:`needs_remote_code`)
    is refused unless ``trust_remote_code``; then its own class is checked like any other."""
    architecture = architecture_of(config)
    spec = lookup(architecture, generic=True)
    if spec.verified and not needs_remote_code(config):
        return spec
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_class = _model_class(config, model_dir, trust_remote_code)
    remote = needs_remote_code(config)
    causal = remote or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type")) == architecture
    if model_class is None or not causal:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported: it is not a decoder-only causal LM that "
            f"transformers {transformers.__version__} knows; kvforge verifies: {supported()}"
        )
    why = generic.refusal(config, model_class)
    if why:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported: {why}; kvforge verifies: {supported()}"
        )
    # remote code, whatever its name, is never a verified entry: generic.spec is unverified
    return generic.spec(architecture or model_class.__name__, model_class)


def probe_generic(model: torch.nn.Module, spec: ArchSpec, max_seq: int | None = None) -> Dims:
    """The cache dimensions of a generic-path model, from what its layers hand the attention
    function (:func:`kvforge.compile.generic.probe_layers`) rather than from config attribute
    names (which some families define per layer). Layers with smaller key or value heads than the
    largest are zero-padded to it by the attention function; layers with fewer KV heads than the
    most any layer has (MiMo-V2-Flash: its sliding layers have twice its full layers') have each
    head repeated by the attention function, which is exact where the largest count divides the
    query heads and is a multiple of every layer's (each query head still reads its own KV head's
    copies; the cache of such a layer takes that many times the memory); layers whose KV heads
    differ otherwise, that do not call the attention function once each, that use chunked attention past ``max_seq``
    (:func:`kvforge.compile.generic.chunked_attention_refusal`), or whose generation cache keeps
    fewer keys than their attention reads within ``max_seq`` tokens
    (:func:`kvforge.compile.generic.window_mismatch`; ``None``: any length) are refused here,
    before export."""
    config = model.config

    def refuse(why: str) -> UnsupportedArchitectureError:
        return UnsupportedArchitectureError(
            f"architecture {spec.architecture!r} is not supported: {why}; kvforge verifies: {supported()}"
        )

    try:
        layers = generic.probe_layers(model, config.num_hidden_layers)
    except generic.ProbeError as e:
        raise refuse(str(e)) from e
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise refuse(
            "its forward fails when its attention runs through AttentionInterface with kvforge's shape probe "
            f"({generic.first_line(e)})"
        ) from e
    mismatch = generic.chunked_attention_refusal(config, max_seq) or generic.window_mismatch(
        layers, generic.generation_cache_windows(config), max_seq
    )
    if mismatch:
        raise refuse(mismatch)
    kv_heads = sorted({s.kv_heads for s in layers})
    if any(kv_heads[-1] % k or s.query_heads % kv_heads[-1] for k in kv_heads for s in layers):
        raise refuse(
            f"its layers differ in KV heads ({', '.join(map(str, kv_heads))}), and kvforge's cache has one "
            "layout for all layers (a layer's heads are repeated to the largest count only where it is a "
            "multiple of every layer's and divides the query heads)"
        )
    return Dims(
        num_layers=len(layers),
        num_heads=max(s.query_heads for s in layers),
        num_kv_heads=kv_heads[-1],
        head_dim=max(max(s.key_dim, s.value_dim) for s in layers),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
    )


class WeightsMismatchError(ModelDirError):
    """The checkpoint's tensors are not the ones its config.json describes."""


def check_loading_info(info: dict, model_dir: str | Path) -> None:
    """Refuse a checkpoint whose tensors do not match its config, naming the first mismatching
    tensor: transformers would load it anyway, with that tensor newly (randomly) initialized.

    ``info`` is ``from_pretrained(..., output_loading_info=True)``'s report (its key renames and
    tied weights already applied): ``mismatched_keys`` (name, checkpoint shape, model shape),
    ``missing_keys`` and ``unexpected_keys``."""
    fix = "the weights are not this config's model: check that config.json and the weight files belong together"
    if info.get("mismatched_keys"):
        name, stored, expected = sorted(info["mismatched_keys"], key=lambda m: m[0])[0]
        raise WeightsMismatchError(
            f"{str(model_dir)!r}: tensor {name!r} has shape {list(stored)} in the checkpoint but the config "
            f"makes it {list(expected)}; {fix}"
        )
    missing = "tensor {name!r} is missing from the checkpoint ({count} missing in all; transformers would "
    missing += "initialize them at random)"
    unexpected = "the checkpoint has tensor {name!r} that the config's model does not ({count} such tensors)"
    for key, problem in (("missing_keys", missing), ("unexpected_keys", unexpected)):
        if info.get(key):
            name = sorted(info[key])[0]
            raise WeightsMismatchError(f"{str(model_dir)!r}: {problem.format(name=name, count=len(info[key]))}; {fix}")


def _from_pretrained(model_dir: str | Path, dtype: str, attention: str, trust_remote_code: bool, **extra):
    """``AutoModelForCausalLM.from_pretrained`` in eval mode, refusing mismatched weights."""
    model, info = _from_pretrained_info(model_dir, dtype, attention, trust_remote_code, **extra)
    check_loading_info(info, model_dir)
    return model


def _from_pretrained_info(model_dir: str | Path, dtype: str, attention: str, trust_remote_code: bool, **extra):
    """``AutoModelForCausalLM.from_pretrained`` in eval mode and its loading report, unchecked."""
    from transformers import AutoModelForCausalLM

    with quiet.no_loading_bar():  # compile reports its own progress
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=DTYPES[dtype],
            attn_implementation=attention,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # report mismatches (check_loading_info) rather than raise mid-load
            **extra,
        )
    return model.eval(), info


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    max_seq: int | None = None,
    stream: bool = False,
) -> LoadedModel:
    """Load the model for export. Checks the directory and the architecture before any weights, and
    the weights against the config (:func:`check_loading_info`). ``trust_remote_code`` lets a family
    that needs its own modeling code (config.json's ``auto_map``) run that code. ``max_seq``: the
    capacity the artifact will have (a generic family whose transformers forward and generate
    disagree past some length is refused only when ``max_seq`` goes past it; None: any length).
    ``stream``: where :mod:`kvforge.compile.streamed` applies (a verified family in safetensors),
    only the traced layers are loaded and the others stay in the checkpoint (``LoadedModel.streamed``)."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    config, weights = read_config(model_dir)
    spec = resolve_spec(config, model_dir, trust_remote_code)

    lowering.register()
    extra = {"experts_implementation": spec.experts_implementation} if spec.experts_implementation else {}
    if stream and spec.verified and spec.state is None and not needs_remote_code(config):  # hybrids: traced whole
        streamed = _load_streamed(Path(model_dir), config, weights, dtype, spec, extra)
        if streamed is not None:
            return streamed
    try:
        model = _from_pretrained(model_dir, dtype, lowering.ATTN_IMPLEMENTATION, trust_remote_code, **extra)
    except ModelDirError:
        raise
    except Exception as e:  # a boundary: any failure to read the directory is the user's to fix
        raise ModelDirError(f"transformers could not load {str(model_dir)!r}: {e}") from e
    if spec.state == "mamba2":  # kvforge's chunked scan for the export traces (transformers' own elsewhere)
        from kvforge.graphs import mamba2

        mamba2.kernelize(model)
    dims = Dims.from_config(model.config) if spec.verified else probe_generic(model, spec, max_seq)
    layout = state_layout(spec, model.config, str(DTYPES[dtype]).removeprefix("torch."))
    if spec.state == "mamba":  # transformers' token-by-token scan -> kvforge's chunked one (graphs/mamba.py)
        mamba.use_chunked_scan(model)
    if spec.state == "conv":  # LFM2's short convolution: kvforge's, with its one-token branch (graphs/state.py)
        from kvforge.graphs import kernel_swap
        from kvforge.graphs import state as export_state

        kernel_swap.kernelize(model, export_state.CONV_KERNELS)
    if any(e.kind == "gated_delta" for e in layout.states):  # transformers' delta rule kernels do not trace
        from kvforge.graphs import gated_delta

        gated_delta.use_export_kernels(model)  # kvforge's, through transformers' kernel hub registration
    return LoadedModel(model, spec, dims, config, weights, layout=layout)


def _load_streamed(model_dir: Path, config: dict, weights: list[Path], dtype: str, spec: ArchSpec, extra: dict):
    """:func:`kvforge.compile.streamed.load`, or None where it does not apply."""
    from transformers import AutoConfig

    from kvforge.compile import streamed

    try:
        total = AutoConfig.from_pretrained(str(model_dir)).num_hidden_layers
        loaded = streamed.load(
            model_dir,
            config,
            weights,
            DTYPES[dtype],
            total,
            lambda **kw: _from_pretrained_info(model_dir, dtype, lowering.ATTN_IMPLEMENTATION, False, **extra, **kw),
        )
    except Exception:  # a boundary: the full load below reports the directory's problem, if any
        return None
    if loaded is None:
        return None
    model, layers = loaded
    return LoadedModel(model, spec, Dims.from_config(model.config), config, weights, streamed=layers)


def load_reference(
    model_dir: str | Path, dtype: str = "float32", attention: str = "eager", trust_remote_code: bool = False
) -> torch.nn.Module:
    """transformers' own model (``attention``: "eager" for parity checks, "sdpa" for speed on a GPU),
    a separate instance with its own config: switching ``_attn_implementation`` on a shared config
    would switch both models. ``trust_remote_code``: as for :func:`load_model`."""
    return _from_pretrained(model_dir, dtype, attention, trust_remote_code)
