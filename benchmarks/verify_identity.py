"""Does a k-token verify call give bit for bit what k one-token steps give? Where it does not, why,
and what the ``exact`` lowering costs (issue 23).

    .venv/bin/python benchmarks/verify_identity.py [OUT ...] [--threads 2] [--rounds 3]

1. One attention node, SmolLM2's shapes (9 query heads, 3 KV heads, head 64, cache 1024, 280
   positions already cached, random data): every row of an S-token call against the same token in a
   one-token call, for ORT's ``GroupQueryAttention`` (with its ``qk_output`` before and after the
   softmax: they are equal, the difference comes from probs·V), ORT's standard ``Attention`` and the
   ``exact`` lowering's plain-op attention (:func:`kvforge.graphs.lowering._exact_attention`).
2. Each artifact ``OUT`` (e.g. SmolLM2 compiled with ``--lowering gqa|onnx|exact``, ``--quantize
   int4``, ``--max-seq 1024``): one 8-token verify call against 8 one-token steps after a 280-token
   prefill, and 16 tokens after 250: max |difference| of the logits and of every layer's keys and
   values written.
3. Cost, ``--rounds`` rounds of a block per artifact, calls of each kind interleaved in it: a plain
   one-token decode step at 280 cached positions (and as a multiple of the first
   artifact's), a 280-token prefill, and a verify call of width 2, 4, 8, 16, 17 in steps of the
   same artifact; and the one-token step at 100, 400, 700, 1000 cached positions.
4. End to end, the artifacts taking turns: predicted_outputs.py's code edit (a ~300-token answer)
   decoded greedily, plain and with n-gram drafts (``ngram:8``) and with the original code as the
   prediction: tokens/s, and whether the tokens are plain decoding's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predicted_outputs import CODE, INSTRUCTION

from kvforge.runtime import Engine, SamplingParams
from kvforge.runtime.speculative import SpeculativeConfig

H, KV, D, CAP, PAST = 9, 3, 64, 1024, 280
WIDTHS = (2, 4, 8, 16, 17)


def _session(nodes, inputs, outputs, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opsets = [helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(helper.make_model(graph, opset_imports=opsets).SerializeToString(), options)


def _tensor(name: str, shape) -> object:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _const(name: str, value) -> object:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(value)], value)
    )


def exact_nodes() -> list:
    """The exact lowering's attention as an ONNX node list (q [1, H, S, D], K/V [1, KV, CAP, D], mask)."""
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [D**-0.5])
    return [
        _const("rows_shape", [0, KV, -1, D]),
        _const("heads_shape", [0, H, -1, D]),
        _const("tiles", [1, 1, H // KV, 1]),
        helper.make_node("Constant", [], ["scale"], value=scale),
        helper.make_node("Constant", [], ["ninf"], value=helper.make_tensor("ninf", TensorProto.FLOAT, [], [-np.inf])),
        helper.make_node("Reshape", ["q", "rows_shape"], ["rows"]),  # (1, KV, G*S, D)
        helper.make_node("Transpose", ["K"], ["Kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["rows", "Kt"], ["qk"]),  # (1, KV, G*S, CAP)
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Tile", ["mask", "tiles"], ["allowed"]),
        helper.make_node("Where", ["allowed", "scores", "ninf"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "V"], ["pv"]),  # (1, KV, G*S, D)
        helper.make_node("Reshape", ["pv", "heads_shape"], ["o"]),
    ]


def nodes(threads: int) -> None:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, KV, CAP, D), dtype=np.float32)
    v = rng.standard_normal((1, KV, CAP, D), dtype=np.float32)
    q = rng.standard_normal((1, H, 40, D), dtype=np.float32)
    # GQA: the new tokens' keys/values are the cache's own rows PAST.., so every call sees the same cache
    gqa = {}
    for qk_output in (1, 2):
        node = helper.make_node(
            "GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["o", "pko", "pvo", "qk"],
            domain="com.microsoft", num_heads=H, kv_num_heads=KV, scale=D**-0.5, qk_output=qk_output,
        )  # fmt: skip
        ins = [_tensor("q", [1, "S", H * D]), _tensor("k", [1, "S", KV * D]), _tensor("v", [1, "S", KV * D])]
        ins += [_tensor("pk", [1, KV, CAP, D]), _tensor("pv", [1, KV, CAP, D])]
        ins += [helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1])]
        ins += [helper.make_tensor_value_info("total", TensorProto.INT32, [])]
        outs = [_tensor(n, None) for n in ("o", "pko", "pvo", "qk")]
        gqa[qk_output] = _session([node], ins, outs, threads)
    mask_in = helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, "S", CAP])
    ins = [_tensor("q", [1, H, "S", D]), _tensor("K", [1, KV, CAP, D]), _tensor("V", [1, KV, CAP, D]), mask_in]
    attention = _session([helper.make_node("Attention", ["q", "K", "V", "mask"], ["o"], scale=D**-0.5)], ins,
                         [_tensor("o", None)], threads)  # fmt: skip
    exact = _session(exact_nodes(), ins, [_tensor("o", None)], threads)

    def flat(x):  # (1, KV, S, D) -> (1, S, KV * D)
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(1, x.shape[2], -1))

    def gqa_call(sess, first: int, s: int):
        last = PAST + first + s - 1
        feed = {"q": flat(q[:, :, first : first + s]), "k": flat(k[:, :, PAST + first : PAST + first + s])}
        feed |= {"v": flat(v[:, :, PAST + first : PAST + first + s]), "pk": k, "pv": v}
        feed |= {"seqlens": np.array([last], np.int32), "total": np.array(last + 1, np.int32)}
        out, _, _, qk = sess.run(None, feed)
        return out.reshape(1, s, H, D).transpose(0, 2, 1, 3), qk[..., : last + 1]

    def plain_call(sess, first: int, s: int):
        mask = np.arange(CAP)[None, :] <= (PAST + first + np.arange(s))[:, None]
        return sess.run(None, {"q": q[:, :, first : first + s].copy(), "K": k, "V": v, "mask": mask[None, None]})[0]

    print(f"1. one attention node, {PAST} cached positions: max|row of an S-token call - that token's 1-token call|")
    for name, call in [
        ("GroupQueryAttention", lambda f, s: gqa_call(gqa[1], f, s)[0]),
        ("Attention (onnx)", lambda f, s: plain_call(attention, f, s)),
        ("exact lowering's ops", lambda f, s: plain_call(exact, f, s)),
    ]:
        ones = np.concatenate([call(j, 1) for j in range(33)], axis=2)
        worst = {s: float(np.abs(call(0, s) - ones[:, :, :s]).max()) for s in (2, 4, 8, 17, 33)}
        print(f"   {name:22s} " + ", ".join(f"S={s}: {w:.2g}" for s, w in worst.items()))
    for qk_output, what in ((1, "Q·Kᵀ (scaled)"), (2, "softmax")):
        many = gqa_call(gqa[qk_output], 0, 8)[1]
        worst = max(float(np.abs(gqa_call(gqa[qk_output], j, 1)[1][0, :, 0] - many[0, :, j, : PAST + j + 1]).max())
                    for j in range(8))  # fmt: skip
        print(f"   GroupQueryAttention's {what}, S=8 rows vs 1-token calls: {worst:.2g}")


PROMPT = [(i * 7919) % 40000 + 50 for i in range(PAST + 40)]
PROMPT_LONG = [(i * 7919) % 40000 + 50 for i in range(1000)]


def identity(path: Path, threads: int) -> None:
    config = SpeculativeConfig(method="prediction", prediction_k=16)
    with Engine.load(path, threads=threads, speculative=config, prefix_cache=0) as e:
        weights = (e.manifest.quantization or {}).get("scheme", e.manifest.dtype)
        found = []
        for n, k in ((PAST, 8), (250, 16)):  # the second crosses MLAS's K-block edge at 256

            def written(n=n, k=k):
                return {name: np.array(c[0, :, n : n + k]) for name, c in e.cache.views(1, 0).items()}

            e.prefill_rows([PROMPT[:n]], [0], 0)
            e.lengths[0] = n
            e.verify_ids(1, k)[0] = PROMPT[n : n + k]
            one_call = e.verify_rows(1, k, 0)[0].copy()
            cache_call = written()
            e.lengths[0] = n
            steps = []
            for token in PROMPT[n : n + k]:
                e.decode_ids(1)[0] = token
                steps.append(e.decode_rows(1, 0)[0].copy())
            cache_steps = written()
            logits = float(np.abs(one_call - np.array(steps)).max())
            cache = max(float(np.abs(cache_call[name] - cache_steps[name]).max()) for name in cache_call)
            bad = [name for name in cache_call if not np.array_equal(cache_call[name], cache_steps[name])]
            where = f" (first differing layer {bad[0].split('.')[1]})" if bad else ""
            found.append(f"{k} tokens at {n}: logits {logits:.2g}, keys/values {cache:.2g}{where}")
        print(f"   {path.name} ({e.manifest.lowering}, {weights}): " + "; ".join(found))


def cost(paths: list[Path], threads: int, rounds: int) -> None:
    """Every call timed alone; per round a block per artifact (its weights stay in the caches), the
    call kinds interleaved call by call inside it (a loaded machine's drift hits all alike); medians."""
    config = SpeculativeConfig(method="prediction", prediction_k=16)
    # one engine per artifact (each session's threads spin a while after a call: a second session
    # timed right after it would share the cores with them); its one-token step is the verify
    # graph's, the same computation as the prefill graph's a plain engine runs
    engines = [Engine.load(p, threads=threads, speculative=config, prefix_cache=0) for p in paths]
    kinds = ["step", *WIDTHS]
    times = {(p.name, kind): [] for p in paths for kind in [*kinds, "prefill"]}
    try:
        for e in engines:
            e.prefill_rows([PROMPT[:PAST]], [0], 0)
        for _ in range(rounds):
            for p, e in zip(paths, engines):  # a block per artifact: its weights stay cached
                for rep in range(-2, 10):  # two warm-up passes, then 10 timed calls of each kind
                    for kind in kinds:
                        started = time.perf_counter()
                        if kind == "step":
                            e.lengths[0] = PAST
                            e.decode_ids(1)[0] = 5
                            e.decode_rows(1, 0)
                        else:
                            _verify(e, kind)
                        if rep >= 0:
                            times[p.name, kind].append(time.perf_counter() - started)
                started = time.perf_counter()
                e.prefill_rows([PROMPT[:PAST]], [0], 0)
                times[p.name, "prefill"].append(time.perf_counter() - started)
        med = statistics.median
        first = paths[0].name
        for p in paths:
            step = med(times[p.name, "step"])
            print(
                f"   {p.name}: step {step * 1e3:.2f} ms ({step / med(times[first, 'step']):.2f}x {first}'s), "
                f"{PAST}-token prefill {med(times[p.name, 'prefill']) * 1e3:.0f} ms; verify call in its steps: "
                + ", ".join(f"width {w} {med(times[p.name, w]) / step:.2f}" for w in WIDTHS)
            )
    finally:
        for e in engines:
            e.close()


def steps_by_context(paths: list[Path], threads: int, rounds: int) -> None:
    """One-token step time at 100 … 1000 cached positions (the attention's share grows with them)."""
    lengths = (100, 400, 700, 1000)
    engines = [Engine.load(p, threads=threads, prefix_cache=0) for p in paths]
    times = {(p.name, n): [] for p in paths for n in lengths}
    try:
        for e in engines:
            e.prefill_rows([PROMPT_LONG], [0], 0)
        for _ in range(rounds):
            for p, e in zip(paths, engines):
                for n in lengths:
                    for rep in range(-3, 15):
                        e.lengths[0] = n - 1
                        e.decode_ids(1)[0] = 5
                        started = time.perf_counter()
                        e.decode_rows(1, 0)
                        if rep >= 0:
                            times[p.name, n].append(time.perf_counter() - started)
        for p in paths:
            print(
                f"   {p.name}: "
                + ", ".join(f"{n}: {statistics.median(times[p.name, n]) * 1e3:.2f} ms" for n in lengths)
            )
    finally:
        for e in engines:
            e.close()


def _verify(engine: Engine, width: int) -> None:
    engine.lengths[0] = PAST
    engine.verify_ids(1, width)[0] = 5
    engine.verify_rows(1, width, 0)


def end_to_end(paths: list[Path], threads: int, rounds: int) -> None:
    messages = [{"role": "user", "content": INSTRUCTION + CODE}]
    runs = {(p.name, how): [] for p in paths for how in ("plain", "ngram:8", "prediction")}
    same = {}
    for _ in range(rounds):
        for p in paths:
            with Engine.load(p, threads=threads, speculative="ngram:8", prefix_cache=0) as e:
                prediction = e.tokenizer.encode(CODE, add_special_tokens=False)
                plain = None
                for how, sampling in [
                    ("plain", SamplingParams(temperature=0, speculative=False)),
                    ("ngram:8", SamplingParams(temperature=0)),
                    ("prediction", SamplingParams(temperature=0, prediction=prediction)),
                ]:
                    started = time.perf_counter()
                    r = e.chat(messages, max_new_tokens=400, sampling=sampling)
                    runs[p.name, how].append(len(r.token_ids) / (time.perf_counter() - started))
                    plain = plain or r.token_ids
                    same[p.name, how] = (r.token_ids == plain, len(r.token_ids), r.accepted_tokens)
    for p in paths:
        base = statistics.median(runs[p.name, "plain"])
        print(
            f"   {p.name}: plain {base:.1f} tokens/s; "
            + "; ".join(
                f"{how} {statistics.median(runs[p.name, how]) / base:.2f}x, "
                f"{'identical' if same[p.name, how][0] else 'DIFFERS'} ({same[p.name, how][1]} tokens, "
                f"{same[p.name, how][2]} accepted)"
                for how in ("ngram:8", "prediction")
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="*", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"load {os.getloadavg()}; onnxruntime {ort.__version__}")
    nodes(args.threads)
    if args.artifacts:
        print("2. one k-token verify call vs k one-token steps: max |difference|")
        for path in args.artifacts:
            identity(path, args.threads)
        print(f"3. cost, {args.rounds} rounds x 10 calls of each kind (medians), {PAST} positions cached")
        cost(args.artifacts, args.threads, args.rounds)
        print(f"3b. one-token step by cached positions, {args.rounds} rounds x 15 (medians)")
        steps_by_context(args.artifacts, args.threads, args.rounds)
        print(f"4. code edit end to end, {args.rounds} rounds (medians)")
        end_to_end(args.artifacts, args.threads, args.rounds)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
