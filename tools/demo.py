"""``kvforge demo``: compile a model, generate with kvforge and with transformers, show both.

Input: a Hugging Face model directory (default: the bundled ``models/kvforge-tiny``) and prompts.
Output, on the terminal: each prompt's continuation from both sides, whether their greedy tokens
are identical, and the tokens/s of each. Exit status 0 when every prompt matched, 1 otherwise.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

DEFAULT_PROMPTS = ("The for statement", "A list is", "Exceptions are")
BUNDLED = Path("models") / "kvforge-tiny"


def bundled_model() -> Path:
    """The bundled model: ``models/kvforge-tiny`` under the working directory or the source tree."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / BUNDLED / "config.json").is_file():
            return root / BUNDLED
    raise ValueError(f"the bundled model {BUNDLED} was not found; pass --model DIR (a Hugging Face model directory)")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _transformers_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def run_demo(
    model_dir: str | Path | None = None,
    prompts: list[str] | None = None,
    out_dir: str | Path | None = None,
    max_new_tokens: int = 48,
) -> int:
    from transformers import AutoModelForCausalLM

    from kvforge.compile import compile_model, quiet
    from kvforge.compile.pipeline import stderr_progress
    from kvforge.runtime import Engine

    model_dir = Path(model_dir) if model_dir else bundled_model()
    prompts = list(prompts or DEFAULT_PROMPTS)
    with tempfile.TemporaryDirectory(prefix="kvforge-demo-") as tmp:
        out = Path(out_dir) if out_dir else Path(tmp) / "artifact"
        _say(f"kvforge demo: {model_dir} -> {out}")
        _say("== 1/3 compile")
        manifest = compile_model(model_dir, out, max_batch=len(prompts), progress=stderr_progress)

        _say("== 2/3 kvforge (ONNX Runtime, CPU)")
        with Engine.load(out) as engine:
            engine.generate(prompts[:1], max_new_tokens=2)  # warm-up: first-run allocations
            start = time.perf_counter()
            ours = [engine.generate([p], max_new_tokens=max_new_tokens)[0] for p in prompts]
            ours_s = time.perf_counter() - start
            batched = engine.generate(prompts, max_new_tokens=max_new_tokens)
            tokenizer = engine.tokenizer
            if tokenizer is None:
                raise ValueError(f"{model_dir} has no tokenizer.json; the demo needs text prompts")

        _say("== 3/3 transformers (eager, same prompts)")
        with quiet.no_loading_bar():  # transformers' "Loading weights" bar would land inside the table
            reference = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
        _transformers_greedy(reference, tokenizer, prompts[0], 2)  # warm-up
        start = time.perf_counter()
        theirs = [_transformers_greedy(reference, tokenizer, p, max_new_tokens) for p in prompts]
        theirs_s = time.perf_counter() - start

    m = manifest.model
    print(
        f"\nmodel: {model_dir} ({m.architecture}, {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_heads} heads / {m.num_kv_heads} KV heads, vocab {m.vocab_size}, {manifest.dtype})"
    )
    all_match = True
    for prompt, mine, ref, row in zip(prompts, ours, theirs, batched):
        same = mine.token_ids == ref
        all_match &= same and row.token_ids == mine.token_ids
        print(f"\nprompt: {prompt!r}")
        print(f"  kvforge      : {mine.text!r}")
        print(f"  transformers : {tokenizer.decode(ref)!r}")
        print(
            f"  greedy tokens identical: {'yes' if same else 'NO'} ({len(mine.token_ids)} vs {len(ref)} tokens)"
            f"; in a ragged batch of {len(prompts)}: {'same' if row.token_ids == mine.token_ids else 'DIFFERENT'}"
        )
    ours_tokens = sum(len(r.token_ids) for r in ours)
    theirs_tokens = sum(len(t) for t in theirs)
    ours_tps, theirs_tps = ours_tokens / ours_s, theirs_tokens / theirs_s
    print(f"\n{'':14}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}")
    print(f"{'kvforge':14}{ours_tokens:8d}{ours_s:10.3f}{ours_tps:10.1f}")
    print(f"{'transformers':14}{theirs_tokens:8d}{theirs_s:10.3f}{theirs_tps:10.1f}")
    print(
        f"kvforge is {ours_tps / theirs_tps:.1f}x transformers eager here (batch 1, greedy, CPU); "
        f"all tokens identical: {'yes' if all_match else 'NO'}"
    )
    return 0 if all_match else 1
