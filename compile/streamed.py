"""Loading in bounded memory: only the traced layers in memory, the others read from the checkpoint.

Compile traces :data:`kvforge.compile.replicate.TRACED` layers and copies the last one in the graph
for the others, so the torch model needs real weights only for those layers, the embedding, the
final norm and the lm_head. :func:`load` builds such a model: transformers' ``from_pretrained``
with the config cut to the traced layers (so transformers itself applies the dtype, tied weights
and buffers), then the stack filled up to its full length with the other layers of the same
model built on the ``meta`` device (no memory; built from the config, so each has its own index
and attributes, checked to be one computation as :func:`kvforge.compile.replicate.plan` checks).
The weights of those layers stay in the checkpoint's safetensors files:

* the graph's copies of them are :class:`onnx_ir.LazyTensor` s (:meth:`StreamedLayers.tensor`)
  that read and convert one tensor when the weights file (or the per-tensor quantizer) takes it;
* transformers' reference forward for the parity check (:meth:`StreamedLayers.materialized`)
  loads each such layer's parameters just before the layer runs and drops them after it.

So the float model is never whole in memory: peak RSS is the traced part, one layer, and what the
later stages hold (the quantized weights, the graph). :func:`load` returns None, and compile loads
the whole model as before, where this does not apply: weights that are not safetensors, a stack of
at most ``TRACED`` layers, an unverified (generic) family, remote code, or a checkpoint whose
tensor names or shapes are not the model's own (a family transformers renames while loading).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import torch

from kvforge.compile import quiet, replicate


@dataclass
class StreamedLayers:
    """The stack's layers ``keep ..`` whose weights stay in the checkpoint."""

    path: str  # the stack's path in the LM ("model.layers")
    keep: int  # layers [0, keep) are in memory
    total: int
    dtype: torch.dtype  # the compile's dtype (the checkpoint's tensors are converted to it)
    files: dict[str, Path]  # checkpoint key -> the safetensors file holding it
    names: list[str]  # parameter names inside a layer ("self_attn.q_proj.weight")

    def key(self, layer: int, name: str) -> str:
        return f"{self.path}.{layer}.{name}"

    def read(self, layer: int, name: str) -> torch.Tensor:
        """Layer ``layer``'s parameter ``name`` from the checkpoint, in the compile's dtype."""
        return self.read_key(self.key(layer, name))

    def read_key(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt") as f:
            tensor = f.get_tensor(key)
        return tensor.to(self.dtype).contiguous()

    def lazy(self, key: str, shape: tuple[int, ...]) -> ir.TensorProtocol:
        """Checkpoint tensor ``key`` as the graph binds it, read when its bytes are taken."""
        from torch.onnx._internal.exporter._core import TorchTensor

        return ir.LazyTensor(
            lambda: TorchTensor(self.read_key(key), name=key),
            dtype=TorchTensor(torch.empty(0, dtype=self.dtype)).dtype,
            shape=ir.Shape(list(shape)),
            name=key,
        )

    def rebind(self, graph_model: ir.Model, model: torch.nn.Module) -> int:
        """Point every initializer of ``graph_model`` that holds one of ``model``'s parameters
        whole (the traced layers, the embedding, the lm_head; or such a parameter transposed
        lazily) at the same tensor in the checkpoint, read when the weights file or the quantizer
        takes it: the torch model's memory goes with the model. Returns how many were rebound."""
        params: dict[int, tuple[str, torch.Tensor]] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            if parameter.device.type != "meta" and name in self.files:
                params.setdefault(parameter.data_ptr(), (name, parameter))
        rebound = 0
        for value in graph_model.graph.initializers.values():
            tensor = value.const_value
            source = getattr(tensor, "kvforge_source", None)
            raw = getattr(source if source is not None else tensor, "raw", None)
            if not isinstance(raw, torch.Tensor) or raw.data_ptr() not in params:
                continue
            key, parameter = params[raw.data_ptr()]
            if raw.shape != parameter.shape or raw.dtype != self.dtype or raw.stride() != parameter.stride():
                continue
            lazy = self.lazy(key, tuple(parameter.shape))
            value.const_value = replicate.transposed_lazily(lazy, value.name) if source is not None else lazy
            rebound += 1
        return rebound

    def streams(self, layer: int) -> bool:
        return self.keep <= layer < self.total

    def tensor(self, layer: int, name: str, shape: tuple[int, ...]) -> ir.TensorProtocol:
        """The parameter as the graph binds it: read and converted only when its bytes are taken."""
        return self.lazy(self.key(layer, name), shape)

    @contextlib.contextmanager
    def materialized(self, model: torch.nn.Module) -> Iterator[None]:
        """Inside the block, each streamed layer of ``model`` loads its parameters from the
        checkpoint as its forward starts and drops them (back to ``meta``) when it ends."""
        stack = replicate.find_stack(model, self.total)
        if isinstance(stack, str):
            raise RuntimeError(f"the streamed stack is gone: {stack}")
        handles = []
        for index in range(self.keep, self.total):
            layer = stack.layers[index]
            handles.append(layer.register_forward_pre_hook(lambda m, _args, i=index: self._fill(m, i)))
            handles.append(layer.register_forward_hook(lambda m, _args, _out: _to_meta(m)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for index in range(self.keep, self.total):
                _to_meta(stack.layers[index])

    def _fill(self, layer: torch.nn.Module, index: int) -> None:
        for name in self.names:
            owner, attribute = _owner(layer, name)
            owner._parameters[attribute] = torch.nn.Parameter(self.read(index, name), requires_grad=False)


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attribute


def _to_meta(layer: torch.nn.Module) -> None:
    for module in layer.modules():
        for attribute, parameter in list(module._parameters.items()):
            if parameter is not None and parameter.device.type != "meta":
                module._parameters[attribute] = torch.nn.Parameter(
                    torch.empty_like(parameter, device="meta"), requires_grad=False
                )


def checkpoint_index(weight_files: list[Path]) -> dict[str, Path] | None:
    """Checkpoint key -> its safetensors file (headers only), or None when some file is not safetensors."""
    if not weight_files or any(f.suffix != ".safetensors" for f in weight_files):
        return None
    from safetensors import safe_open

    files = {}
    for path in weight_files:
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def _shapes(files: dict[str, Path], keys: list[str]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(files[key], []).append(key)
    shapes = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in names:
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _truncated_config(model_dir: Path, keep: int, total: int, trust_remote_code: bool):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    full = {"num_hidden_layers": total}
    config.num_hidden_layers = keep
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == total:
        full["layer_types"] = layer_types
        config.layer_types = layer_types[:keep]
    return config, full


def load(
    model_dir: Path,
    config_json: dict,
    weight_files: list[Path],
    dtype: torch.dtype,
    total: int,
    from_pretrained,
) -> tuple[torch.nn.Module, StreamedLayers] | None:
    """The model with layers ``[0, TRACED)`` loaded and the others streamed (see the module's
    docstring), or None where streaming does not apply. ``from_pretrained(config=...)`` loads
    the cut model (the caller's loader: its attention and checks); ``total`` is the stack's
    length in ``config_json``."""
    keep = replicate.TRACED
    if total <= keep or json.dumps(config_json.get("auto_map") or {}) != "{}":
        return None
    files = checkpoint_index(weight_files)
    if files is None:
        return None
    skeleton = _skeleton(model_dir, dtype, total)
    if skeleton is None:
        return None
    config, full = _truncated_config(model_dir, keep, total, False)
    with quiet.quiet_logger("transformers.modeling_utils"):  # its report lists the layers left out
        model, info = from_pretrained(config=config)
    stack = replicate.find_stack(model, keep)
    if isinstance(stack, str) or stack.path != skeleton.path:
        return None
    unexpected = set(info.get("unexpected_keys") or [])
    streamed_keys = {k for k in files if k.startswith(f"{stack.path}.") and _layer_of(k, stack.path) >= keep}
    if unexpected - streamed_keys or info.get("missing_keys") or info.get("mismatched_keys"):
        return None  # transformers renamed or rebuilt something: the full load decides
    names = [name for name, _ in stack.layers[keep - 1].named_parameters(remove_duplicate=False)]
    clones = skeleton.layers[keep:]
    wanted = {f"{stack.path}.{i}.{n}": p for i, c in enumerate(clones, keep) for n, p in c.named_parameters()}
    if set(wanted) != streamed_keys or any(b.device.type == "meta" for c in clones for b in c.buffers()):
        return None  # other tensors than the model's, or a layer buffer that only a real load makes
    shapes = _shapes(files, list(wanted))
    if any(shapes[key] != tuple(p.shape) for key, p in wanted.items()):
        return None
    for key, value in full.items():
        setattr(model.config, key, value)
    _share_config(clones, skeleton.config, model.config)
    setattr(stack.parent, stack.attribute, torch.nn.ModuleList([*stack.layers, *clones]))
    return model, StreamedLayers(stack.path, keep, total, dtype, files, names)


def _skeleton(model_dir: Path, dtype: torch.dtype, total: int):
    """The whole model on the ``meta`` device (no memory), its stack (a :class:`replicate.LayerStack`
    whose ``config`` is the skeleton's), or None when its layers are not all one computation
    (:func:`replicate.plan`'s checks: the full load and full trace handle those)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()  # no dropout
    stack = replicate.find_stack(model, total)
    if isinstance(stack, str) or replicate._config_difference(model, total):
        return None
    if replicate._layer_difference(stack.layers):
        return None
    return _Skeleton(stack.path, stack.layers, model.config)


@dataclass
class _Skeleton:
    path: str
    layers: tuple
    config: object


def _share_config(layers, old, new) -> None:
    """Point the layers' config attributes (and sub-configs) from the skeleton's config at the
    loaded model's: an attention switch on the model's config must reach every layer (DESIGN.md)."""
    mapping = {id(old): new}
    for key, value in vars(old).items():
        if _is_config(value) and _is_config(getattr(new, key, None)):
            mapping[id(value)] = getattr(new, key)
    for layer in layers:
        for module in layer.modules():
            for key, value in list(vars(module).items()):
                if id(value) in mapping:
                    setattr(module, key, mapping[id(value)])


def _is_config(value: object) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _layer_of(key: str, path: str) -> int:
    head = key[len(path) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else -1
