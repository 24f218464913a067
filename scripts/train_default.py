"""Train kvforge's bundled default model, ``kvforge-tiny``, fully offline.

Input: English text that ships with CPython itself under the PSF license --
the pydoc documentation topics in :data:`pydoc_data.topics.topics` (the text
behind ``help("for")`` etc.) plus the docstrings of the importable standard
library modules. Nothing is downloaded.

Output: a standard Hugging Face model directory (default
``models/kvforge-tiny``) containing ``config.json``, ``model.safetensors``
(fp32), ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` and a ``README.md`` model card with the held-out
perplexity, example generations and the command used to produce it.

The model is a small Llama (``LlamaForCausalLM``) with grouped-query
attention, so that the compiler has a real GQA / RoPE / RMSNorm model to test
against without network access. It is trained from scratch on two CPU cores
in roughly a quarter of an hour.

Usage::

    python scripts/train_default.py --out models/kvforge-tiny

It lives outside the installed package (it is how the bundled model was made, not part of
kvforge) and imports nothing from kvforge: torch, transformers and tokenizers are enough.

Tokenizer convention: encoding never inserts special tokens automatically.
``<|endoftext|>`` (id 0) is bos, eos and pad at once; during training every
document is *preceded* by it, so callers that want the in-distribution start
of a document may prepend it themselves, but plain prompts work as well.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import inspect
import io
import json
import math
import os
import platform
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Must be set before ``tokenizers`` spins up its thread pool: the BPE trainer
# is then single threaded, which keeps merge order independent of scheduling.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOT = "<|endoftext|>"

# Modules whose import has visible side effects (opens a browser, prints the
# Zen of Python, needs a display) or that are tooling rather than library
# documentation. ``pydoc_data`` is skipped because its text is used directly.
_SKIP_MODULES = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "venv",
        "pydoc_data",
    }
)

EXAMPLE_PROMPTS = ("The for statement", "A list is", "Exceptions are")


@dataclass
class TrainArgs:
    """Hyper-parameters; recorded verbatim in the model card."""

    out: str
    steps: int
    seed: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    context: int
    batch_size: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    threads: int
    log_every: int
    eval_every: int
    no_docstrings: bool


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def _module_docstrings(name: str, seen: set[str]) -> str | None:
    """Concatenate the docstrings of ``name`` and its public classes/functions.

    Only objects *defined* in the module are used (``__module__`` check) so a
    re-exported class is documented once; ``seen`` de-duplicates identical
    docstrings across modules (e.g. inherited method docs). Iteration is over
    sorted names so the result does not depend on dict ordering.
    """
    try:
        # Some modules print or warn on import; keep the log clean.
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
    except BaseException:
        return None

    parts: list[str] = []

    def add(obj: object) -> None:
        doc = getattr(obj, "__doc__", None)
        if not isinstance(doc, str):
            return
        doc = inspect.cleandoc(doc).strip()
        # Very short docstrings ("Return self.") are noise for a language model.
        if len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            parts.append(doc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. typing.io deprecation on access
        add(module)
        members = vars(module)
        for key in sorted(members):
            if key.startswith("_"):
                continue
            obj = members[key]
            is_api = inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)
            if not is_api or getattr(obj, "__module__", None) != name:
                continue
            add(obj)
            if inspect.isclass(obj):
                for attr in sorted(vars(obj)):
                    if not attr.startswith("_"):
                        add(vars(obj)[attr])
    return "\n\n".join(parts) if parts else None


def build_corpus(use_docstrings: bool = True) -> tuple[list[str], list[str]]:
    """Return ``(train_docs, heldout_docs)``.

    Documents are the pydoc topics (sorted by key) followed by one document
    per standard-library module (sorted by name). Every 10th document of each
    source is held out, so the split is fixed and covers both kinds of text.
    Exact content depends on the CPython version that runs this script.
    """
    from pydoc_data.topics import topics

    sources: list[list[str]] = [[topics[k].strip() for k in sorted(topics)]]
    if use_docstrings:
        seen: set[str] = set()
        names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_"))
        module_docs = []
        for name in names:
            if name in _SKIP_MODULES:
                continue
            doc = _module_docstrings(name, seen)
            if doc:
                module_docs.append(doc)
        sources.append(module_docs)

    train: list[str] = []
    heldout: list[str] = []
    for docs in sources:
        for i, doc in enumerate(docs):
            (heldout if i % 10 == 9 else train).append(doc)
    return train, heldout


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE tokenizer on ``docs``.

    No post-processor is attached, so ``encode`` adds no special tokens: the
    compiler's runtime feeds prompts verbatim and must not be surprised by an
    implicit bos. ``<|endoftext|>`` is the only special token and gets id 0.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        # Seed all 256 byte symbols so any text (non-ASCII too) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, docs: Sequence[str]) -> torch.Tensor:
    """Encode documents into one token stream, each preceded by ``<|endoftext|>``."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    backend = tokenizer.backend_tokenizer  # no post-processor: no specials added
    ids: list[int] = []
    for doc in docs:
        ids.append(eot)
        # Whole documents exceed model_max_length; the backend doesn't warn.
        ids.extend(backend.encode(doc).ids)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------
# Model / training
# --------------------------------------------------------------------------


def make_model(a: TrainArgs, vocab_size: int, eot_id: int) -> LlamaForCausalLM:
    """Build the randomly initialised Llama; initialisation uses the global seed."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.hidden_size // a.num_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        use_cache=True,
        attention_bias=False,
        mlp_bias=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    # SDPA is ~1.4x faster than "eager" for CPU training here and its CPU
    # kernels are deterministic; the math (and thus the saved model) is the same.
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def lr_at(step: int, a: TrainArgs) -> float:
    """Linear warmup then cosine decay to ``min_lr`` (step is 0-based)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor, context: int, batch_size: int) -> float:
    """Mean next-token NLL (nats) over non-overlapping ``context`` windows of ``stream``."""
    model.eval()
    n_windows = (len(stream) - 1) // context
    total_nll, total_tokens = 0.0, 0
    for start in range(0, n_windows, batch_size):
        rows = range(start, min(n_windows, start + batch_size))
        x = torch.stack([stream[r * context : r * context + context] for r in rows])
        y = torch.stack([stream[r * context + 1 : r * context + context + 1] for r in rows])
        logits = model(input_ids=x).logits
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += y.numel()
    model.train()
    return total_nll / max(1, total_tokens)


def _cpu_name() -> str:
    """Human-readable CPU model for the card (Linux), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt_secs(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def train(
    model: LlamaForCausalLM,
    train_stream: torch.Tensor,
    eval_stream: torch.Tensor,
    a: TrainArgs,
) -> list[dict[str, float]]:
    """Run AdamW on random ``context``-token windows; returns the logged history."""
    # Weight decay only on matrices, not on norms (standard practice; decaying
    # RMSNorm gains towards 0 just fights the loss).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    # A private generator makes batch order a pure function of --seed, immune
    # to any RNG use inside transformers.
    gen = torch.Generator().manual_seed(a.seed + 1)
    n_starts = len(train_stream) - a.context - 1
    offsets = torch.arange(a.context + 1)
    history: list[dict[str, float]] = []
    model.train()
    t0 = time.perf_counter()
    tokens_per_step = a.batch_size * a.context
    for step in range(a.steps):
        lr = lr_at(step, a)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, n_starts, (a.batch_size,), generator=gen)
        chunk = train_stream[starts[:, None] + offsets[None, :]]
        x, y = chunk[:, :-1], chunk[:, 1:]
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        done = step + 1
        do_eval = bool(a.eval_every) and done % a.eval_every == 0 and done != a.steps
        if do_eval or done % a.log_every == 0 or done == 1 or done == a.steps:
            elapsed = time.perf_counter() - t0
            tok_s = done * tokens_per_step / elapsed
            eta = elapsed / done * (a.steps - done)
            rec = {"step": done, "loss": loss.item(), "lr": lr, "elapsed_s": elapsed}
            msg = (
                f"step {done:5d}/{a.steps}  loss {loss.item():.4f}  lr {lr:.2e}  "
                f"{tok_s:,.0f} tok/s  elapsed {_fmt_secs(elapsed)}  eta {_fmt_secs(eta)}"
            )
            if do_eval:
                rec["heldout_loss"] = evaluate(model, eval_stream, a.context, a.batch_size)
                msg += f"  heldout {rec['heldout_loss']:.4f} (ppl {math.exp(rec['heldout_loss']):.1f})"
            history.append(rec)
            print(msg, file=sys.stderr, flush=True)
    return history


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _fp16_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Copy with fp16 parameters but fp32 buffers, like ``from_pretrained(dtype=float16)``.

    ``Module.to(float16)`` would also round the RoPE ``inv_freq`` buffer, an
    error a real fp16 deployment does not have (it flips extra argmaxes).
    """
    half = copy.deepcopy(model)
    for param in half.parameters():  # tied embedding is yielded once and stays tied
        param.data = param.data.to(torch.float16)
    return half


@dataclass
class Example:
    """One greedy generation and how robust its argmax choices are."""

    prompt: str
    completion: str
    min_margin: float  # smallest top-1 minus top-2 logit over the generated steps
    median_margin: float
    fp16_same: bool  # does an fp16 copy of the model generate the same tokens?


@torch.no_grad()
def greedy_examples(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    n: int = 40,
) -> list[Example]:
    """Greedy continuations, their top-1 logit margins and an fp16 cross-check.

    Margins matter to kvforge: comparing fp16 graphs against the fp32
    reference by greedy tokens is only meaningful where no step is a near tie.
    """
    model.eval()
    half = _fp16_copy(model)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        kw = {"do_sample": False, "max_new_tokens": n, "pad_token_id": tokenizer.pad_token_id}
        res = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kw)
        top2 = torch.stack([s[0] for s in res.scores]).topk(2).values
        margins = top2[:, 0] - top2[:, 1]
        seq16 = half.generate(ids, **kw)
        text = tokenizer.decode(res.sequences[0, ids.shape[1] :], skip_special_tokens=False)
        out.append(
            Example(
                prompt=prompt,
                completion=text,
                min_margin=float(margins.min()),
                median_margin=float(margins.median()),
                fp16_same=bool(torch.equal(seq16, res.sequences)),
            )
        )
    return out


@torch.no_grad()
def margin_stats(model: LlamaForCausalLM, stream: torch.Tensor, context: int, batch_size: int) -> dict[str, float]:
    """Teacher-forced top-1 margin statistics and fp16 argmax agreement on ``stream``."""
    model.eval()
    half = _fp16_copy(model)
    n_windows = (len(stream) - 1) // context
    x = stream[: n_windows * context].view(n_windows, context)
    margins, flips = [], 0
    for start in range(0, n_windows, batch_size):
        xb = x[start : start + batch_size]
        logits = model(input_ids=xb).logits
        top2 = logits.topk(2, dim=-1).values
        margins.append((top2[..., 0] - top2[..., 1]).flatten())
        flips += int((half(input_ids=xb).logits.argmax(-1) != logits.argmax(-1)).sum())
    m = torch.cat(margins)
    return {
        "positions": float(m.numel()),
        "median": float(m.median()),
        "frac_below_0.01": float((m < 0.01).float().mean()),
        "frac_below_0.1": float((m < 0.1).float().mean()),
        "fp16_flips": float(flips),
    }


def write_model_card(
    out: Path,
    a: TrainArgs,
    model: LlamaForCausalLM,
    info: dict[str, object],
    examples: list[Example],
    history: list[dict[str, float]],
) -> None:
    """Write README.md documenting architecture, data, training and results."""
    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    # transformers 5 keeps RoPE settings in ``rope_parameters``; 4.x in ``rope_theta``.
    rope = getattr(c, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    argv: list[str] = info["argv"]  # type: ignore[assignment]
    cmd = " ".join(["python scripts/train_default.py", *map(shlex.quote, argv)])
    curve = "\n".join(
        f"| {int(h['step'])} | {h['loss']:.3f} | " + (f"{h['heldout_loss']:.3f} |" if "heldout_loss" in h else " |")
        for h in history
    )
    ex = "\n\n".join(
        f"**Prompt:** `{e.prompt}` -- top-1 logit margin over the generated steps: median "
        f"{e.median_margin:.2f}, min {e.min_margin:.3f}; an fp16 copy generates the same tokens: "
        f"{'yes' if e.fp16_same else 'no'}\n\n```text\n{e.prompt}{e.completion}\n```"
        for e in examples
    )
    ms: dict[str, float] = info["margins"]  # type: ignore[assignment]
    hp = json.dumps(asdict(a), indent=2)
    card = f"""---
license: other
license_name: psf-2.0
license_link: https://docs.python.org/3/license.html
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, gqa, kvforge, test-model]
---

# kvforge-tiny

A tiny Llama-architecture causal LM trained from scratch, offline, on CPython's
own documentation. It is kvforge's bundled default model: small enough to ship
in the repository and to compile in seconds, but *trained*: its logits are
peaked (typical top-1 margin far above fp16 rounding error) and its greedy text
is recognisable documentation English, so mismatches between the PyTorch
reference and the compiled ONNX prefill/decode graphs show up clearly.
It is a test fixture, not a useful language model.

## Architecture

| | |
|---|---|
| class | `LlamaForCausalLM` |
| layers | {c.num_hidden_layers} |
| hidden size | {c.hidden_size} |
| intermediate (SwiGLU) size | {c.intermediate_size} |
| attention heads | {c.num_attention_heads} (head_dim {c.head_dim}) |
| key/value heads (GQA) | {c.num_key_value_heads} |
| vocab size | {c.vocab_size} |
| max positions | {c.max_position_embeddings} (RoPE, theta {rope_theta}, default scaling) |
| norm | RMSNorm, eps {c.rms_norm_eps} |
| tied input/output embeddings | {c.tie_word_embeddings} |
| parameters | {n_params:,} |
| weights | `model.safetensors`, float32 |

## Training data

{info["n_train_docs"]} training documents / {info["n_heldout_docs"]} held-out documents
({info["train_chars"]:,} / {info["heldout_chars"]:,} characters;
{info["train_tokens"]:,} / {info["heldout_tokens"]:,} tokens), all text that
ships with CPython {info["python"]} and is covered by the
[PSF License Agreement](https://docs.python.org/3/license.html):

* the pydoc documentation topics `pydoc_data.topics.topics` (the text shown by
  `help("for")`, `help("exceptions")`, ...), one document per topic;
* docstrings of the importable standard-library modules and of their public
  classes, methods and functions (sorted module list; modules that fail to
  import on this platform are skipped), one document per module.

Every 10th document of each source (in sorted order) is held out for
evaluation. The exact text depends on the CPython version and build used.

## Tokenizer

Byte-level BPE (GPT-2 style: `ByteLevel` pre-tokenizer without prefix space,
`ByteLevel` decoder) trained with `tokenizers` on the training split,
{c.vocab_size} entries. The single special token `<|endoftext|>` (id
{c.eos_token_id}) is bos, eos and pad. **Encoding adds no special tokens**; in
training every document is preceded by `<|endoftext|>`, so prepend it yourself
if you want a document-start context. Prompts without it work fine.

## Training

AdamW (betas 0.9/0.95, weight decay {a.weight_decay} on matrices), linear warmup
{a.warmup} steps then cosine decay {a.lr:g} -> {a.min_lr:g}, gradient clipping
1.0, {a.steps} steps of {a.batch_size} x {a.context} tokens
({a.steps * a.batch_size * a.context:,} tokens, about
{a.steps * a.batch_size * a.context / max(1, int(info["train_tokens"])):.1f} epochs), fp32, seed {a.seed},
`torch.use_deterministic_algorithms(True)`, {a.threads} CPU threads.

* wall time: {info["train_seconds"] / 60:.1f} min of training
  ({info["total_seconds"] / 60:.1f} min end to end, average
  {a.steps * a.batch_size * a.context / float(info["train_seconds"]):,.0f} training tokens/s)
  on {info["cpu"]}; 1-minute load average {info["loadavg"]} when training
  ended (above {a.threads} means other processes shared the cores and
  stretched the wall time)
* final training loss (last step): {history[-1]["loss"]:.3f}
* **held-out loss {info["heldout_loss"]:.3f} nats/token, perplexity {math.exp(info["heldout_loss"]):.1f}**,
  {info["heldout_bpb"]:.3f} bits per byte (training-split perplexity
  {math.exp(info["train_eval_loss"]):.1f}, measured the same way on the first
  {info["train_eval_tokens"]:,} training tokens)
* software: torch {torch.__version__}, transformers {info["transformers"]}, tokenizers {info["tokenizers"]}

| step | train loss | held-out loss |
|---|---|---|
{curve}

## Logit margins and fp16

Teacher-forced on the {int(ms["positions"]):,} held-out positions, the fp32
top-1 minus top-2 logit margin has median {ms["median"]:.2f};
{100 * ms["frac_below_0.01"]:.1f}% of positions have a margin below 0.01 and
{100 * ms["frac_below_0.1"]:.1f}% below 0.1 (near ties are unavoidable in any
LM). An fp16 copy of the model picks a different argmax at
{int(ms["fp16_flips"])} of them. Compare low-precision graphs against the
reference by logits with a tolerance, or by argmax only where the reference
margin clearly exceeds the expected error; long greedy generations can
legitimately diverge after a near tie.

## Example greedy generations

`generate(do_sample=False, max_new_tokens=40)`, fp32, prompt without bos:

{ex}

## Reproduce

From the repository root of kvforge (the script imports nothing from kvforge;
torch, transformers and tokenizers are enough):

```bash
{cmd}
```

Hyper-parameters used:

```json
{hp}
```

The batch order and initialisation are functions of `--seed` only, and
deterministic algorithms are enforced, so a rerun on the same software and CPU
reproduces the same loss curve; bitwise-identical weights across different
CPUs, thread counts or library versions are not guaranteed.
"""
    (out / "README.md").write_text(card, encoding="utf-8")


def parse_args(argv: Sequence[str] | None) -> TrainArgs:
    p = argparse.ArgumentParser(
        prog="python scripts/train_default.py",
        description="Train the bundled kvforge-tiny Llama model offline on CPython's documentation.",
    )
    p.add_argument("--out", default="models/kvforge-tiny", help="output model directory")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--context", type=int, default=256, help="training sequence length")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=200, help="0 disables intermediate eval")
    p.add_argument("--no-docstrings", action="store_true", help="use only the pydoc topics")
    ns = p.parse_args(argv)
    a = TrainArgs(**vars(ns))
    if a.hidden_size % a.num_heads or a.num_heads % a.num_kv_heads:
        p.error("hidden size must divide by heads and heads by kv heads")
    a.warmup = min(a.warmup, max(1, a.steps // 10))
    return a


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: build corpus, train tokenizer and model, evaluate, save."""
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(raw_argv)
    t_start = time.perf_counter()

    # Determinism: fixed seeds, single process, a fixed thread count, and
    # deterministic kernels (raises if an op has no deterministic variant).
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    train_docs, heldout_docs = build_corpus(use_docstrings=not a.no_docstrings)
    log(
        f"corpus: {len(train_docs)} train docs ({sum(map(len, train_docs)):,} chars), "
        f"{len(heldout_docs)} held-out docs ({sum(map(len, heldout_docs)):,} chars)"
    )

    tokenizer = train_tokenizer(train_docs, a.vocab_size)
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    train_stream = encode_stream(tokenizer, train_docs)
    eval_stream = encode_stream(tokenizer, heldout_docs)
    log(f"tokenizer: vocab {len(tokenizer)}; {len(train_stream):,} train / {len(eval_stream):,} held-out tokens")

    model = make_model(a, len(tokenizer), eot_id)
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")

    t_train = time.perf_counter()
    history = train(model, train_stream, eval_stream, a)
    train_seconds = time.perf_counter() - t_train
    loadavg = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"

    heldout_loss = evaluate(model, eval_stream, a.context, a.batch_size)
    # Same-size slice of the training stream: the gap shows how much it memorised.
    train_eval = train_stream[: len(eval_stream)]
    train_eval_loss = evaluate(model, train_eval, a.context, a.batch_size)
    n_eval_tokens = ((len(eval_stream) - 1) // a.context) * a.context
    eval_bytes = len(tokenizer.decode(eval_stream[1 : n_eval_tokens + 1].tolist()).encode("utf-8"))
    heldout_bpb = heldout_loss * n_eval_tokens / eval_bytes / math.log(2)
    log(f"held-out loss {heldout_loss:.4f}  ppl {math.exp(heldout_loss):.2f}  bpb {heldout_bpb:.3f}")

    margins = margin_stats(model, eval_stream, a.context, a.batch_size)
    log(f"held-out top-1 margins: {margins}")
    examples = greedy_examples(model, tokenizer, EXAMPLE_PROMPTS)
    for e in examples:
        log(f"[{e.prompt}] -> {e.completion!r}  (margin min {e.min_margin:.3f}, fp16 same: {e.fp16_same})")

    # ---- save ------------------------------------------------------------
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 records its internal class name "TokenizersBackend";
    # "PreTrainedTokenizerFast" names the same thing and also loads on 4.x.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")

    import tokenizers
    import transformers

    info: dict[str, object] = {
        "argv": raw_argv,
        "n_train_docs": len(train_docs),
        "n_heldout_docs": len(heldout_docs),
        "train_chars": sum(map(len, train_docs)),
        "heldout_chars": sum(map(len, heldout_docs)),
        "train_tokens": len(train_stream),
        "heldout_tokens": len(eval_stream),
        "python": platform.python_version(),
        "cpu": f"{a.threads} threads of {_cpu_name()}",
        "loadavg": loadavg,
        "margins": margins,
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - t_start,
        "heldout_loss": heldout_loss,
        "heldout_bpb": heldout_bpb,
        "train_eval_loss": train_eval_loss,
        "train_eval_tokens": len(train_eval),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    write_model_card(out, a, model, info, examples, history)
    log(f"saved to {out} in {_fmt_secs(time.perf_counter() - t_start)}")


if __name__ == "__main__":
    main()
