"""llguidance vs xgrammar on one tokenizer and one schema: what kvforge's choice of engine rests on.

For each engine, in one process, alternating engine by engine ``--rounds`` times:

* tokenizer info: building the engine's per-vocabulary state from ``tokenizer.json`` (once per
  engine in kvforge);
* compile: turning the JSON schema into a matcher ready for its first mask (once per request);
* mask: the time of one "next-token bitmask" call per step (int32 bitmask ``[ceil(V/32)]``), walking
  the tokens of a valid instance of the schema (the tokenizer's own encoding of it), p50 and p99
  over every step of every round;
* what each package installs and requires (``importlib.metadata``; sizes of the installed files).

xgrammar needs transformers (its ``TokenizerInfo.from_huggingface``) and torch (its bitmask is a
torch tensor): those are the reason it is here only as the baseline. Run with both installed::

    pip install llguidance xgrammar
    python benchmarks/grammar_engines.py --tokenizer ~/.cache/kvforge/smollm2/hf --rounds 5
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "admin", "user"]}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
        },
        "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
    },
    "required": ["name", "age", "email", "tags", "address", "score"],
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["admin", "user", "a"],
    "address": {"street": "12 St James's Square, London", "zip": "01234"},
    "score": 0.75,
}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def dist_size(name: str) -> float:
    """MiB of the files a distribution installed."""
    dist = importlib.metadata.distribution(name)
    total = 0
    for f in dist.files or []:
        p = Path(dist.locate_file(f))
        if p.is_file():
            total += p.stat().st_size
    return total / 2**20


def run_llguidance(tok_json: str, eos: int, ids: list[int], vocab: int) -> dict:
    import llguidance as llg

    t = time.perf_counter()
    tok = llg.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)
    mask = np.full((vocab + 31) // 32, -1, dtype=np.int32)
    m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # first mask: part of the compile here
    t_compile = time.perf_counter() - t
    assert not m.is_error(), m.get_error()
    steps = []
    for i, token in enumerate(ids):
        if i:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            steps.append(time.perf_counter() - t)
        assert (mask[token >> 5] >> (token & 31)) & 1, f"llguidance masked out the instance's token {i}"
        assert m.consume_token(token), m.get_error()
    return {"tokenizer_s": t_tok, "compile_s": t_compile, "mask_s": steps}


def run_xgrammar(hf_dir: str, ids: list[int], vocab: int) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    mask = xgr.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(mask)
    t_compile = time.perf_counter() - t
    steps = []
    for i, token in enumerate(ids):
        if i:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            steps.append(time.perf_counter() - t)
        word = int(mask[0, token >> 5].item())
        assert (word >> (token & 31)) & 1, f"xgrammar masked out the instance's token {i}"
        assert m.accept_token(token)
    del torch
    return {"tokenizer_s": t_tok, "compile_s": t_compile, "mask_s": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokenizer",
        default=str(Path("~/.cache/kvforge/smollm2/hf").expanduser()),
        help="an HF directory with tokenizer.json",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok_json = (Path(args.tokenizer) / "tokenizer.json").read_text(encoding="utf-8")
    tk = Tokenizer.from_str(tok_json)
    vocab = tk.get_vocab_size(with_added_tokens=True)
    eos = tk.token_to_id("<|im_end|>") or 0
    ids = tk.encode(json.dumps(INSTANCE), add_special_tokens=False).ids
    runs: dict[str, list[dict]] = {"llguidance": [], "xgrammar": []}
    for _ in range(args.rounds):
        runs["llguidance"].append(run_llguidance(tok_json, eos, ids, vocab))
        runs["xgrammar"].append(run_xgrammar(args.tokenizer, ids, vocab))
    out = {"vocab": vocab, "steps": len(ids) - 1, "rounds": args.rounds}
    for name, rs in runs.items():
        masks = [s * 1e3 for r in rs for s in r["mask_s"]]
        requires = importlib.metadata.requires(name) or []
        out[name] = {
            "version": importlib.metadata.version(name),
            "tokenizer_ms": statistics.median(r["tokenizer_s"] for r in rs) * 1e3,
            "compile_ms": statistics.median(r["compile_s"] for r in rs) * 1e3,
            "mask_ms_p50": pct(masks, 50),
            "mask_ms_p99": pct(masks, 99),
            "installed_mib": round(dist_size(name), 1),
            "requires": [r.split(";")[0].strip() for r in requires if "extra ==" not in r],
        }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
