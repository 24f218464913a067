"""scripts/train_default.py, the script that made the bundled model, runs from its place outside the
installed package (as a user runs it: ``python scripts/train_default.py``, in a fresh process) and
writes a Hugging Face directory that transformers loads, with a model card whose "Reproduce"
command names that path. A few steps of a tiny model on the pydoc topics only: seconds, not the
quarter hour of the real run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvforge.tools

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_default.py"
TINY = [
    *("--steps", "2", "--no-docstrings", "--vocab-size", "300", "--hidden-size", "32"),
    *("--intermediate-size", "64", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1"),
    *("--context", "32", "--batch-size", "2", "--eval-every", "0", "--warmup", "1", "--threads", "1"),
]


def test_the_training_script_is_not_in_the_package():
    assert not (Path(kvforge.tools.__file__).parent / "train_default.py").exists()
    assert SCRIPT.is_file()


def test_the_training_script_runs_from_scripts(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *TINY], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert f"saved to {out}" in done.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (1, 32)
    assert len(AutoTokenizer.from_pretrained(out)) == model.config.vocab_size
    card = (out / "README.md").read_text()
    assert f"python scripts/train_default.py --out {out} --steps 2" in card
