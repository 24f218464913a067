"""Greedy decode speed of kvforge (ORT CPU) vs transformers eager, measured in the same run.

Builds a random Llama of the given shape in a temp dir (no download), compiles it, and times, for
both sides, greedy generation of 1 token (≈ time to first token) and of N tokens on the same
prompt; decode time per token = (t_N - t_1) / (N - 1). Medians over --repeat runs after a warm-up.
Prints compile time, artifact size and a table with the kvforge/transformers ratio.

    python benchmarks/decode_speed.py                      # 4 layers, hidden 256
    python benchmarks/decode_speed.py --layers 30 --hidden 576 --heads 9 --kv-heads 3 --vocab 49152
    python benchmarks/decode_speed.py --shape lfm2-350m   # a named shape of common.MODEL_SHAPES (any family)

``--shape`` builds a published model's shape (``common.MODEL_SHAPES``: LFM2-350M, Qwen3.5-0.8B,
their full-attention Llama twins) instead of a Llama from the size options; hybrid_bench.py runs
the fuller comparison (prefill against the twin, state bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def build_model(path: Path, args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=args.tied,
        bos_token_id=None,
        eos_token_id=None,  # no early stop: both sides generate exactly N tokens
        pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(common.MODEL_SHAPES), default=None, help="a named shape (any family)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from kvforge.compile import compile_model
    from kvforge.runtime import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out = Path(tmp) / "model", Path(tmp) / "out"
        if args.shape:
            common.build_shape(args.shape, model_dir)
            args.vocab = common.MODEL_SHAPES[args.shape].config["vocab_size"]
        else:
            build_model(model_dir, args)
        start = time.perf_counter()
        compile_model(model_dir, out, max_batch=1, max_seq=args.prompt_len + args.new_tokens, progress=None)
        compile_s = time.perf_counter() - start
        size = sum(f.stat().st_size for f in out.iterdir())
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())

        prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
        reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()

        def hf(n: int):
            with torch.no_grad():
                return reference.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False
                )

        rows = {}
        with Engine.load(out, threads=args.threads) as engine:
            ids = prompt[0].tolist()
            ours = engine.generate([ids], max_new_tokens=args.new_tokens)[0].token_ids
            theirs = hf(args.new_tokens)[0, args.prompt_len :].tolist()
            for name, run in (
                ("kvforge (ORT CPU)", lambda n: engine.generate([ids], max_new_tokens=n)),
                ("transformers eager", hf),
            ):
                t1 = median_time(lambda run=run: run(1), args.repeat)
                tn = median_time(lambda run=run: run(args.new_tokens), args.repeat)
                rows[name] = (t1, (tn - t1) / (args.new_tokens - 1), tn)

    described = (
        f"{args.shape} ({common.MODEL_SHAPES[args.shape].source})"
        if args.shape
        else f"Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} kv"
    )
    print(f"model: {described}, vocab {args.vocab}, {params / 1e6:.1f}M params (fp32)")
    print(f"compile: {compile_s:.1f}s, artifact {size / 2**20:.1f} MiB (fp32 params {params * 4 / 2**20:.1f} MiB)")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, median of {args.repeat}")
    print(f"greedy tokens identical: {ours == theirs}")
    print(f"{'':22}{'TTFT ms':>10}{'decode ms/tok':>15}{'decode tok/s':>14}{'end-to-end s':>14}")
    for name, (t1, step, tn) in rows.items():
        print(f"{name:22}{t1 * 1e3:10.2f}{step * 1e3:15.3f}{1 / step:14.1f}{tn:14.3f}")
    (k1, ks, kn), (h1, hs, hn) = rows.values()
    print(f"{'speed-up (hf/kvforge)':22}{h1 / k1:10.2f}{hs / ks:15.2f}{hs / ks:14.2f}{hn / kn:14.2f}")


if __name__ == "__main__":
    main()
