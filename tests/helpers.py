"""Test helpers: tiny model builders, tolerance checks that print the worst element, transformers references."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

KEY = "test-key"  # the API key of the test servers (tests/tools/test_serve.py's ``running``)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """The module of ``benchmarks/NAME.py`` (not a package: its directory goes on ``sys.path`` for the
    scripts it imports, and the module into ``sys.modules`` for dataclasses that look it up)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))  # last: benchmarks/coverage.py must not hide a package
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def assert_close(actual, expected, atol: float, rtol: float, what: str = "logits") -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` everywhere; on failure, report the worst element."""
    actual = torch.as_tensor(actual).float()
    expected = torch.as_tensor(expected).float()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    excess = (actual - expected).abs() - (atol + rtol * expected.abs())
    worst = int(excess.argmax())
    if excess.flatten()[worst] > 0:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
        raise AssertionError(
            f"{what} differ beyond atol={atol} rtol={rtol}: worst at {idx}: "
            f"{float(actual[idx]):.6g} vs reference {float(expected[idx]):.6g} "
            f"(max |diff| {float((actual - expected).abs().max()):.3g})"
        )


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation for one prompt: the generated ids only."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``tokens``: ``[T, V]``."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


TEXT = (
    "The for statement iterates over the items of any sequence. A list is a mutable sequence. "
    "Exceptions are raised when an error occurs. The while loop repeats while a condition holds. "
    "Functions are defined with def and return a value. Classes bundle data and behaviour together."
)


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained in-process on a few sentences (vocab <= vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))


def make_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random Llama (GQA: 4 query heads, 2 KV heads) with a tokenizer to ``path``."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=config["eos_token_id"], bos_token_id=0, pad_token_id=0).save_pretrained(path)
    save_tokenizer(path, config["vocab_size"])
    return path


def corrupt_head_size(graph_file: Path) -> None:
    """Rewrite a graph so it still loads but cannot run: every ``Reshape`` whose constant target
    shape infers one dim (``-1``) asks for one more in its largest fixed dim (the lm_head's
    ``[-1, hidden]`` becomes ``[-1, hidden + 1]``), which the graph's symbolic batch and sequence
    dims hide from shape inference at load, and ORT finds only when the Reshape runs. For the
    refusal of a graph that loads with verify=False and fails when it runs (tests of GraphRunError)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(graph_file, load_external_data=False)
    targets = {n.input[1] for n in model.graph.node if n.op_type == "Reshape"}
    changed = 0
    for t in model.graph.initializer:
        if t.name in targets and t.data_type == onnx.TensorProto.INT64:
            values = numpy_helper.to_array(t).copy()
            if -1 in values.tolist() and values.max() > 1:
                values[values.argmax()] += 1
                t.CopyFrom(numpy_helper.from_array(values, t.name))
                changed += 1
    assert changed, f"{graph_file} has no Reshape to a constant shape with an inferred dim to corrupt"
    onnx.save(model, graph_file)


def check_delta_rule_branches(graph, layers, fast: bool = False) -> None:
    """Each linear-attention layer in ``layers`` (an ONNX ``GraphProto``'s ``/model/layers.{i}/``
    scopes) runs its delta rule as one ``If`` on the length (a one-token branch with no loop, a
    chunked one whose only loop is one ``Scan``), or (``fast``: the gqa lowering, either rule) as
    one ``com.microsoft`` ``LinearAttention`` that reads the layer's recurrent past itself; its
    short convolutions as ``If``s (one window: no ``Conv``; longer: one ``Conv``); nothing else in
    the graph loops or convolves, and no pass outside the rule zeroes new sequences' recurrent
    states (the rule does it)."""
    import onnx

    ops = [n.op_type for n in graph.node]
    assert "Scan" not in ops and "Loop" not in ops and "Conv" not in ops
    recurrent = {v.name for v in graph.input if v.name.startswith("past_state.") and v.name.endswith(".recurrent")}
    assert len(recurrent) == len(layers), recurrent
    readers = [(n.op_type, n.domain) for n in graph.node if recurrent & set(n.input)]
    # only the rule reads them: the fast path's node, or the If's branches (outer-scope names, not node inputs)
    assert readers == ([("LinearAttention", "com.microsoft")] * len(layers) if fast else []), readers
    rules, convs = {}, {}
    if fast:
        for node in (n for n in graph.node if n.op_type == "LinearAttention"):
            layer = next(i for i in layers if f"/model/layers.{i}/" in node.name)
            rules[layer] = rules.get(layer, 0) + 1
    for node in (n for n in graph.node if n.op_type == "If"):
        graphs = {a.name: [n.op_type for n in onnx.helper.get_attribute_value(a).node] for a in node.attribute}
        layer = next(i for i in layers if f"/model/layers.{i}/" in node.name)
        step, longer = graphs["then_branch"], graphs["else_branch"]
        assert "Scan" not in step and "Loop" not in step and "Conv" not in step, (node.name, step)
        kind = rules if "Scan" in longer else convs
        assert not (fast and kind is rules), node.name
        kind[layer] = kind.get(layer, 0) + 1
        assert longer.count("Scan" if kind is rules else "Conv") == 1 and "Loop" not in longer, (node.name, longer)
    assert rules == dict.fromkeys(layers, 1), rules
    assert set(convs) == set(layers), convs


def check_state_features(artifact, prompt: list[int], turn: list[int], new: int = 8) -> None:
    """A hybrid artifact (layers that keep a state) with the prefix cache on (its default) and
    prompt-lookup drafting gives the tokens of an engine with neither. The lead prompt is
    ``prompt``, its greedy continuation, then ``prompt`` again, so prompt lookup may draft that
    continuation; a prediction (the plain answer with one token changed halfway) is drafted for
    certain, accepted up to the change and rejected there (the row re-runs what it kept); a chat's
    next turn (the lead, its answer, ``turn``) resumes from the state snapshot the first answer left."""
    from kvforge.runtime import Engine, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    with Engine.load(artifact, threads=1, prefix_cache=0) as plain:
        [continuation] = plain.generate([prompt], max_new_tokens=new, sampling=greedy)
        lead = prompt + continuation.token_ids + prompt
        [first] = plain.generate([lead], max_new_tokens=new, sampling=greedy)
        follow_up = lead + first.token_ids + turn
        [second] = plain.generate([follow_up], max_new_tokens=new, sampling=greedy)
    wrong = list(first.token_ids)
    wrong[new // 2] = (wrong[new // 2] + 1) % 256
    with Engine.load(artifact, threads=1, speculative="ngram:4") as engine:
        [a] = engine.generate([lead], max_new_tokens=new, sampling=greedy)
        [b] = engine.generate([follow_up], max_new_tokens=new, sampling=greedy)
        [c] = engine.generate([lead], max_new_tokens=new, sampling=SamplingParams(temperature=0.0, prediction=wrong))
    assert (a.token_ids, b.token_ids, c.token_ids) == (first.token_ids, second.token_ids, first.token_ids)
    assert c.prediction_accepted >= new // 2 - 1 and c.prediction_rejected > 0, (
        c.prediction_accepted,
        c.prediction_rejected,
    )
    assert b.cached_tokens >= len(lead) + len(first.token_ids) - 1, b.cached_tokens


# ------------------------------------------------------------------ checks every stateful family runs


def check_prefill_and_decode_logits(engine, reference, prompt: list[int], atol: float, rtol: float, steps: int = 5):
    """The prefill's logits and ``steps`` greedy decode steps' against transformers' one forward
    over the prompt and the tokens fed back, within ``atol``/``rtol``."""
    ours = [engine.prefill([prompt])[0].copy()]
    tokens = [int(ours[0].argmax())]
    for _ in range(steps):
        ours.append(engine.decode([tokens[-1]])[0].copy())
        tokens.append(int(ours[-1].argmax()))
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].numpy()
    for step, (got, want) in enumerate(zip(ours, theirs)):
        assert_close(got, want, atol, rtol, f"step {step}")


def check_chunked_prefill(engine, prompt: list[int], cuts, label: str = "") -> None:
    """``prompt`` prefilled in the chunks each of ``cuts`` ends at (a cut is the chunks' stop
    positions, the last one ``len(prompt)``) gives the logits of one prefill, within 1e-5 and the
    same argmax, and the decode step after it the same logits: the state (and KV) a chunk leaves is
    the one the next chunk continues from."""
    whole = engine.prefill([prompt])[0].copy()
    after_whole = engine.decode([5])[0].copy()
    for cut in cuts:
        start = 0
        for stop in cut:
            logits = engine.prefill([prompt[start:stop]], start=[start])[0].copy()
            start = stop
        np.testing.assert_array_equal(logits.argmax(), whole.argmax())
        assert_close(logits, whole, 1e-5, 1e-5, f"{label}chunks {cut}")
        assert_close(engine.decode([5])[0], after_whole, 1e-5, 1e-5, f"{label}decode after chunks {cut}")


def check_greedy_at_both_ends_of_max_seq(engine, reference, label: str = "") -> None:
    """Greedy output equals transformers' for a 1-token prompt run to the row's last position and
    for a prompt as long as the row (one token, finish reason "length")."""
    max_seq = engine.max_seq
    [short] = engine.generate([[9]], max_new_tokens=max_seq - 1)
    assert short.token_ids == hf_greedy(reference, [9], max_seq - 1), label
    full = [(7 * i + 3) % 256 for i in range(max_seq)]
    [last] = engine.generate([full], max_new_tokens=4)
    assert last.token_ids == hf_greedy(reference, full, 1) and last.finish_reason == "length", label


def check_in_flight_batching(engine, reference, prompts, new, prefill_chunk: int = 4, label: str = "") -> None:
    """More requests than rows through the scheduler, long prompts prefilled in chunks of
    ``prefill_chunk`` beside decoding rows, queued requests taking finished rows (whose state and
    KV are compacted with them): each request gets transformers' greedy tokens."""
    expected = [hf_greedy(reference, p, n) for p, n in zip(prompts, new)]
    saved_chunk, engine.prefill_chunk = engine.prefill_chunk, prefill_chunk
    try:
        with engine.scheduler() as sched:
            handles = [sched.submit(p, max_new_tokens=n) for p, n in zip(prompts, new)]
            results = [h.result(timeout=120) for h in handles]
    finally:
        engine.prefill_chunk = saved_chunk
    for i, (result, tokens) in enumerate(zip(results, expected)):
        assert result.token_ids == tokens, f"{label}request {i}"
