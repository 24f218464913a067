"""Model directories compile refuses before export, and the one it runs only when trusted.

Proves (issue #14, item 4):
- a ``config.json`` whose model type needs remote code (``auto_map``, a type transformers does not
  ship) is refused with a message naming the code and ``--trust-remote-code``, before any weights
  are read; with ``trust_remote_code=True`` the same directory compiles on the generic path and its
  greedy tokens equal transformers' (running the same remote code); the manifest records the trust;
- a checkpoint whose weights do not match its config (a tensor of another shape, a tensor missing,
  an extra tensor) is refused with the first mismatching tensor's name, where transformers alone
  would load it with that tensor initialized at random.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge.compile import compile_model
from kvforge.compile.load import WeightsMismatchError, load_model
from kvforge.graphs.architectures import UnsupportedArchitectureError
from tests.helpers import hf_greedy

CONFIGURATION = """
from transformers import LlamaConfig


class KvfTinyConfig(LlamaConfig):
    model_type = "kvftiny"
"""

MODELING = """
from transformers import LlamaForCausalLM

from .configuration_kvftiny import KvfTinyConfig


class KvfTinyForCausalLM(LlamaForCausalLM):
    config_class = KvfTinyConfig
"""


@pytest.fixture(scope="module")
def remote_dir(llama_dir, tmp_path_factory) -> Path:
    """The session's tiny Llama, re-labelled as a model type only its own code defines."""
    root = tmp_path_factory.mktemp("remote") / "kvftiny"
    shutil.copytree(llama_dir, root)
    (root / "configuration_kvftiny.py").write_text(CONFIGURATION)
    (root / "modeling_kvftiny.py").write_text(MODELING)
    config = json.loads((root / "config.json").read_text())
    config.update(
        model_type="kvftiny",
        architectures=["KvfTinyForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_kvftiny.KvfTinyConfig",
            "AutoModelForCausalLM": "modeling_kvftiny.KvfTinyForCausalLM",
        },
    )
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_remote_code_is_refused_without_trust(remote_dir, tmp_path):
    with pytest.raises(UnsupportedArchitectureError) as refused:
        compile_model(remote_dir, tmp_path / "out", progress=None)
    message = str(refused.value)
    assert "model type 'kvftiny' needs remote code" in message
    assert "'modeling_kvftiny.KvfTinyForCausalLM'" in message
    assert "--trust-remote-code" in message
    assert not (tmp_path / "out").exists()


def test_remote_code_refusal_on_the_cli(remote_dir, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "kvforge.tools.cli", "compile", str(remote_dir), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "needs remote code" in run.stderr and "--trust-remote-code" in run.stderr
    assert "Traceback" not in run.stderr


def test_trusted_remote_code_compiles_token_exact(remote_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from kvforge.runtime import Engine

    out = tmp_path / "out"
    manifest = compile_model(remote_dir, out, max_batch=1, max_seq=48, trust_remote_code=True, progress=None)
    assert manifest.model.architecture == "KvfTinyForCausalLM"
    assert manifest.parity["verified_family"] is False  # its own code: the generic path, parity-gated
    assert manifest.parity["greedy_match"] is True
    assert manifest.source["trust_remote_code"] is True

    reference = AutoModelForCausalLM.from_pretrained(str(remote_dir), trust_remote_code=True).eval()
    assert type(reference).__name__ == "KvfTinyForCausalLM"
    prompt = [5, 17, 42, 99, 3, 250]
    with Engine.load(out) as engine:
        ours = engine.generate([prompt], max_new_tokens=16)[0].token_ids
    assert ours == hf_greedy(reference, prompt, 16)


def _edited_copy(llama_dir: Path, root: Path, edit) -> Path:
    shutil.copytree(llama_dir, root)
    weights = root / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})
    return root


@pytest.mark.parametrize(
    "case, edit, message",
    [
        (
            "shape",
            lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight", torch.zeros(16, 64)),
            r"tensor 'model.layers.1.self_attn.k_proj.weight' has shape \[16, 64\] in the checkpoint "
            r"but the config makes it \[32, 64\]",
        ),
        (
            "missing",
            lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("model.layers.0.mlp.down_proj.weight")),
            r"tensor 'model.layers.0.mlp.down_proj.weight' is missing from the checkpoint \(2 missing in all; "
            r"transformers would initialize them at random\)",
        ),
        (
            "extra",
            lambda t: t.__setitem__("model.layers.2.mlp.up_proj.weight", torch.zeros(128, 64)),
            r"the checkpoint has tensor 'model.layers.2.mlp.up_proj.weight' that the config's model does not",
        ),
    ],
)
def test_weights_that_do_not_match_the_config_are_refused(llama_dir, tmp_path, case, edit, message):
    model_dir = _edited_copy(llama_dir, tmp_path / case, edit)
    with pytest.raises(WeightsMismatchError, match=message):
        load_model(model_dir)
    with pytest.raises(WeightsMismatchError, match="check that config.json and the weight files belong together"):
        compile_model(model_dir, tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()
