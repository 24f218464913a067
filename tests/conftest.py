"""Shared fixtures: tiny random models saved to temp dirs, and their compiled artifacts.

Built once per session (compiling takes seconds), so the suite stays fast as it grows. Nothing is
downloaded: configs are written in-process and saved with ``save_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import make_llama

try:  # hypothesis profiles of tests/test_fuzz.py (hypothesis is in the dev extra)
    from hypothesis import HealthCheck, settings

    _FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # ci (default): bounded and deterministic, the whole fuzz file in well under a minute on 2 cores.
    settings.register_profile("ci", max_examples=100, derandomize=True, print_blob=True, **_FUZZ)
    # long: `HYPOTHESIS_PROFILE=long` (scripts/fuzz.sh), many more random examples.
    settings.register_profile("long", max_examples=2000, derandomize=False, print_blob=True, **_FUZZ)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # the fuzz file skips itself without hypothesis
    pass


@pytest.fixture(scope="session", autouse=True)
def calibration_folder(tmp_path_factory) -> Path:
    """The int8 prefill's stored calibrations (``kvforge.runtime.int8_prefill.cached_ranges``) go to
    a folder of the session, set in the environment so that servers started as processes use it too:
    the suite writes nothing into the user's ``~/.cache/kvforge``."""
    folder = tmp_path_factory.mktemp("calibration")
    os.environ["KVFORGE_CALIBRATION"] = str(folder)
    return folder


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
def llama_int4_artifact(llama_dir, tmp_path_factory) -> Path:
    """The same model with int4 weights (``--quantize int4``: MatMulNBits, the lm_head 8-bit)."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "llama-int4"
    compile_model(llama_dir, out, max_batch=4, max_seq=96, quantize="int4", progress=None)
    return out


@pytest.fixture(scope="session")
def llama_int8_artifact(llama_dir, tmp_path_factory) -> Path:
    """The same model with an 8-bit KV cache (``--kv-dtype int8``: the onnx lowering); its float twin
    is ``llama_onnx_artifact``."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "llama-int8"
    compile_model(llama_dir, out, max_batch=4, max_seq=96, kv_dtype="int8", progress=None)
    return out


@pytest.fixture(scope="session")
def gemma2_onnx_artifact(tmp_path_factory) -> Path:
    """The tiny Gemma-2 of tests/families.py (attention soft-cap 5.0, 2 layers) under the onnx
    lowering; graphs only: no score graph, no ORT-optimized copies."""
    from kvforge.compile import compile_model
    from tests import families

    root = tmp_path_factory.mktemp("gemma2")
    [case] = [c for c in families.CASES if c[0] == "gemma2-softcap-window"]
    model_dir = families.build(root / "model", *case[1:])
    out = root / "out"
    compile_model(
        model_dir, out, max_batch=1, max_seq=32, lowering="onnx", score_graph=False, optimize=False, progress=None
    )
    return out


@pytest.fixture(scope="session")
def lfm2_dir(tmp_path_factory) -> Path:
    """The tiny LFM2 of tests/families.py (short-convolution layers 0, 2, 3, a conv state each, and
    one attention layer, 1) with a vocabulary of 384, eos id 0 and a tokenizer, so that text
    prompts, stop strings and grammars run on it."""
    from transformers import GenerationConfig

    from tests import families
    from tests.helpers import save_tokenizer

    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == "lfm2"]
    overrides = {**overrides, "vocab_size": 384, "eos_token_id": 0}
    path = families.build(tmp_path_factory.mktemp("lfm2") / "model", architecture, config_class, overrides)
    GenerationConfig(eos_token_id=0).save_pretrained(path)
    save_tokenizer(path, 384)
    return path


@pytest.fixture(scope="session")
def lfm2_artifact(lfm2_dir, tmp_path_factory) -> Path:
    """The tiny LFM2 compiled with the default lowering (gqa, ORT-optimized graphs), max_batch 2,
    max_seq 48, with its score graph: the hybrid family's runtime tests run on it."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "lfm2"
    compile_model(lfm2_dir, out, max_batch=2, max_seq=48, progress=None)
    return out


@pytest.fixture(scope="session")
def mamba_dir(tmp_path_factory) -> Path:
    """The tiny Mamba of tests/families.py (two mixer layers, a conv state and a scan state each,
    no attention layer)."""
    from tests import families

    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == "mamba"]
    return families.build(tmp_path_factory.mktemp("mamba") / "model", architecture, config_class, overrides)


@pytest.fixture(scope="session")
def mamba_artifact(mamba_dir, tmp_path_factory) -> Path:
    """The tiny Mamba compiled with the default lowering (ORT-optimized graphs), max_batch 2,
    max_seq 48 (prompts cross its 32-token scan chunk); no score graph."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "mamba"
    compile_model(mamba_dir, out, max_batch=2, max_seq=48, score_graph=False, progress=None)
    return out


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3.5 of tests/families.py: Gated DeltaNet layers 0, 2, 3 (a conv and a float32
    recurrent state each) and one attention layer, 1, with a vocabulary of 384, eos id 0 and a
    tokenizer (as ``lfm2_dir``), so that the batch-loop features run on it."""
    from transformers import GenerationConfig

    from tests import families
    from tests.helpers import save_tokenizer

    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == "qwen3.5"]
    overrides = {**overrides, "vocab_size": 384, "eos_token_id": 0}
    path = families.build(tmp_path_factory.mktemp("qwen35") / "model", architecture, config_class, overrides)
    GenerationConfig(eos_token_id=0).save_pretrained(path)
    save_tokenizer(path, 384)
    return path


@pytest.fixture(scope="session")
def granite_artifact(tmp_path_factory) -> Path:
    """The tiny Granite 4 of tests/families.py (Mamba2 layers 0, 2, 3 beside attention layer 1, MoE
    MLPs) with a vocabulary of 384, eos id 0 and a tokenizer (as ``lfm2_dir``), compiled with the
    default lowering (gqa: each Mamba2 scan one ORT ``LinearAttention``), max_batch 2, max_seq 80,
    no score graph: the batch-loop features on a Mamba2 hybrid."""
    from transformers import GenerationConfig

    from kvforge.compile import compile_model
    from tests import families
    from tests.helpers import save_tokenizer

    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == "granitemoehybrid"]
    overrides = {**overrides, "vocab_size": 384, "eos_token_id": 0}
    path = families.build(tmp_path_factory.mktemp("granite") / "model", architecture, config_class, overrides)
    GenerationConfig(eos_token_id=0).save_pretrained(path)
    save_tokenizer(path, 384)
    out = tmp_path_factory.mktemp("artifacts") / "granite"
    compile_model(path, out, max_batch=2, max_seq=80, score_graph=False, progress=None)
    return out


@pytest.fixture(scope="session")
def qwen35_artifact(qwen35_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3.5 compiled with the default lowering (gqa, ORT-optimized graphs), max_batch 2,
    max_seq 80 (a prompt can cross the 64-token chunk of the delta rule), no score graph."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "qwen35"
    compile_model(qwen35_dir, out, max_batch=2, max_seq=80, score_graph=False, progress=None)
    return out


@pytest.fixture(scope="session")
def llama_reference(llama_dir):
    """transformers' model of ``llama_dir`` (eager attention), the reference for every comparison."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="eager").eval()


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def llama_chat_artifact(llama_dir, tmp_path_factory) -> Path:
    """``llama_dir``'s model with a ChatML chat template in its tokenizer_config.json (max_batch 2,
    max_seq 256, no score graph): the artifact chat, sessions' chat and ``kvforge chat`` run on."""
    import json
    import shutil

    from kvforge.compile import compile_model

    model = tmp_path_factory.mktemp("llama-chat") / "model"
    shutil.copytree(llama_dir, model)
    config = {
        "chat_template": CHATML_TEMPLATE,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path_factory.mktemp("artifacts") / "llama-chat"
    compile_model(model, out, max_batch=2, max_seq=256, score_graph=False, progress=None)
    return out


def pytest_runtest_setup(item) -> None:
    """Skip ``@pytest.mark.gpu`` tests cleanly where their GPU stack is absent, saying what is missing.

    ``@pytest.mark.gpu`` needs CUDA; ``@pytest.mark.gpu("tensorrt")`` also TensorRT >= 10.15,
    ``@pytest.mark.gpu("ort")`` also ONNX Runtime's CUDA provider (onnxruntime-gpu)."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    from kvforge.graphs import environment

    gpu = environment.cuda_gpu()
    if isinstance(gpu, str):
        pytest.skip(f"needs CUDA: {gpu}")
    needs = set(marker.args) | set(item.callspec.params.values() if hasattr(item, "callspec") else ())
    if "tensorrt" in needs:
        trt = environment.tensorrt_module()
        if isinstance(trt, str):
            pytest.skip(f"needs TensorRT: {trt}")
    if "ort" in needs:
        reason = environment.ort_cuda_provider()
        if reason:
            pytest.skip(f"needs ORT's CUDA provider: {reason}")


BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "models" / "kvforge-tiny"


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> Path:
    """The bundled trained model (models/kvforge-tiny, vocab 4096, eos id 0) compiled with max_batch 8,
    max_seq 512, no score graph: structured output's tests run on it."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "kvforge-tiny"
    compile_model(BUNDLED_MODEL, out, max_batch=8, max_seq=512, score_graph=False, progress=None)
    return out


@pytest.fixture(scope="session")
def tiny_onnx_artifact(tmp_path_factory) -> Path:
    """The bundled model under the standard-ONNX lowering (max_batch 8, max_seq 512, no score graph),
    where a verify call checks several rows' drafts at once (GroupQueryAttention verifies one row)."""
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("artifacts") / "kvforge-tiny-onnx"
    compile_model(BUNDLED_MODEL, out, max_batch=8, max_seq=512, lowering="onnx", score_graph=False, progress=None)
    return out


SMOLLM2_DIR = Path(os.environ.get("KVFORGE_SMOLLM2", "~/.cache/kvforge/smollm2/hf")).expanduser()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an HF directory (``make smollm2``, or ``$KVFORGE_SMOLLM2``);
    the ``real_model`` tests skip, saying how to get it, where it is absent."""
    if not (SMOLLM2_DIR / "config.json").is_file():
        pytest.skip(
            f"no SmolLM2 directory at {SMOLLM2_DIR}: run `make smollm2`, or set KVFORGE_SMOLLM2 to a converted "
            "SmolLM2-135M-Instruct directory"
        )
    return SMOLLM2_DIR


# The OpenAI-compatible server's test modules (tests/tools/test_serve*.py, tests/serve/) each start a
# server as their module fixture ``served`` (url, server); these two fixtures serve them all.


@pytest.fixture(scope="module")
def client(served):
    """The official OpenAI client of the module's ``served`` server (API key ``tests.helpers.KEY``)."""
    import openai

    from tests.helpers import KEY

    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine(llama_chat_artifact):
    """The reference outputs: an engine on the served chat artifact, in this process (a module on
    another artifact defines its own ``engine``)."""
    from kvforge.runtime import Engine

    with Engine.load(llama_chat_artifact, threads=1) as e:
        yield e
