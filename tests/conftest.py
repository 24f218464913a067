"""Shared fixtures: tiny random models saved to temp dirs, and their compiled artifacts.

Built once per session (compiling takes seconds), so the suite stays fast as it grows. Nothing is
downloaded: configs are written in-process and saved with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import make_llama


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama_artifact(llama_dir, tmp_path_factory) -> Path:
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "llama"
    compile_model(llama_dir, out, max_batch=4, max_seq=96, progress=None)  # default lowering: gqa
    return out


@pytest.fixture(scope="session")
def llama_onnx_artifact(llama_dir, tmp_path_factory) -> Path:
    """The same model under the standard-ONNX lowering (the graph TensorRT builds from)."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "llama-onnx"
    compile_model(llama_dir, out, max_batch=4, max_seq=96, lowering="onnx", progress=None)
    return out


@pytest.fixture(scope="session")
def llama_reference(llama_dir):
    """transformers' model of ``llama_dir`` (eager attention), the reference for every comparison."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager").eval()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_llama_artifact(llama_dir, tmp_path_factory) -> Path:
    """``llama_dir``'s model with a chat template (a Zephyr-style one, in ``tokenizer_config.json``
    with bos/eos tokens), compiled once (gqa, max_batch 4, max_seq 96, no score graph)."""
    import json
    import shutil

    from kvforge.compile import compile_model

    model = tmp_path_factory.mktemp("chat-llama")
    for f in llama_dir.iterdir():
        shutil.copy2(f, model / f.name)
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path_factory.mktemp("artifacts") / "chat-llama"
    compile_model(model, out, max_batch=4, max_seq=96, score_graph=False, progress=None)
    return out
