"""Coverage survey: every causal-LM family transformers ships, compiled tiny and checked token by token.

Walks ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (one row per ``model_type``), builds a tiny config for
each from its config class's defaults shrunk (:func:`tiny_config`), saves a seeded random model,
runs :func:`kvforge.compile.compile_model` on it in a subprocess with a timeout, and checks greedy
tokens against transformers twice: compile's parity record (``greedy_match``) and a few greedy
steps of :class:`kvforge.runtime.Engine` against transformers' ``generate``. Each family gets one
result (:data:`RESULTS`); ``docs/coverage.md`` gets one row per family, the counts, the versions and
the command. Results are cached per family under ``--work`` so an interrupted run resumes.

    .venv/bin/python benchmarks/coverage.py                      # the full survey (about an hour on 2 cores)
    .venv/bin/python benchmarks/coverage.py --only llama,gpt2    # some model types
    .venv/bin/python benchmarks/coverage.py --sample             # the fixed CI sample (SAMPLE)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORK = ROOT / ".coverage-work"
DEFAULT_DOC = ROOT / "docs" / "coverage.md"
DEFAULT_TIMEOUT = 180.0

TOKEN_EXACT = "token-exact"
REFUSED = "refused"
FAILED = "failed"
NOT_DECODER = "not a decoder-only LM"
HF_FAILS = "transformers itself fails"
RESULTS = (TOKEN_EXACT, REFUSED, FAILED, NOT_DECODER, HF_FAILS)

# The CI sample: one family per distinct path, with its expected result and a phrase of its detail
# (tests/compile/test_coverage.py asserts both).
SAMPLE = {
    "stablelm": (TOKEN_EXACT, ""),  # generic path; no _supports_attention_backend flag, no kwargs to attention
    "phi": (TOKEN_EXACT, ""),  # partial rotary, parallel attention + MLP residual
    "olmoe": (TOKEN_EXACT, ""),  # MoE on the generic path (experts exported with batched_mm)
    "cohere": (TOKEN_EXACT, ""),  # logits * config.logit_scale, read from the family's forward
    "modernbert-decoder": (TOKEN_EXACT, ""),  # a prediction head between the decoder and the output embeddings
    "rwkv": (REFUSED, "WKV recurrence on the CPU"),  # refused before export
    "moshi": (REFUSED, "generation cache keeps only their last 8 keys"),  # refused at load, by the shape probe
    "bert": (NOT_DECODER, "encoder"),  # an encoder the mapping lists for causal LM
}

PROMPT = [3, 17, 42, 5, 99, 7, 23, 11]
NEW_TOKENS = 6
COMPILE_MAX_SEQ = 32

# ------------------------------------------------------------------------------------ tiny configs

LAYERS = 2
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_SIZE = {
    # width and heads: hidden 64 = 4 heads x 16
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "n_embed": 64,
    "embedding_size": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "attention_heads": 4,
    "head_dim": 16,
    "kv_channels": 16,
    "attention_head_dim": 16,
    "attention_head_size": 16,
    "d_head": 16,
    "dim_head": 16,
    # feed-forward
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "dim_ff": 128,
    "d_inner": 128,
    "ffn_hidden_size": 128,
    "feed_forward_size": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "shared_experts_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "expert_ffn_hidden_size": 64,
    # experts: 4, two per token, one group
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    # multi-head latent attention
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    # positions, windows, rotary
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "sliding_window": 8,
    "sliding_window_size": 8,
    "attention_window_size": 8,
    "rotary_dim": 8,
    "vocab_size": 256,
}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_EXPERT_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")
_ZERO = ("num_kv_shared_layers",)  # layers reusing another layer's cache: none among the few kept
_MIN_ONE = ("first_k_dense_replace", "num_dense_layers")  # dense layers before the MoE ones
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _is_index_list(key: str, value, layers: int) -> bool:
    """A list of layer indices (Llama 4's ``moe_layers``), not one value per layer: a ``*layer*``
    key holding increasing ints below ``layers``."""
    return (
        "layer" in key
        and isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value)
        and all(a < b for a, b in itertools.pairwise(value))
    )


def _layer_selection(d: dict, layers: int) -> list[int] | None:
    """Indices of the default layers to keep: the first layer of each distinct combination of the
    per-layer lists (``layer_types``, ``mlp_layer_types``, ...), padded to at least ``LAYERS``."""
    lists = [
        v
        for k, v in d.items()
        if isinstance(v, list) and len(v) == layers and k not in _TOKEN_KEYS and not _is_index_list(k, v, layers)
    ]
    if not lists:
        return None
    keep: list[int] = []
    seen = set()
    for i in range(layers):
        signature = json.dumps([lst[i] for lst in lists], default=str)
        if signature not in seen:
            seen.add(signature)
            keep.append(i)
    for i in range(layers):
        if len(keep) >= LAYERS:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def shrink(d: dict, nested: bool = False) -> dict:
    """A config dict (``to_dict()`` of a config's defaults) with its sizes made tiny. Nested
    configs (``text_config``, ``vision_config``, ...) are shrunk the same way."""
    d = dict(d)
    for key, value in list(d.items()):
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            d[key] = shrink(value, nested=True)
    layers = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    if layers:
        keep = _layer_selection(d, layers) or list(range(min(layers, LAYERS)))
        for key in _LAYER_KEYS:
            if isinstance(d.get(key), int):
                d[key] = len(keep)
        for key, value in list(d.items()):
            if key in _TOKEN_KEYS:
                continue
            if _is_index_list(key, value, layers):  # the kept layers among those listed, renumbered
                d[key] = [new for new, old in enumerate(keep) if old in set(value)]
            elif isinstance(value, list) and len(value) == layers:
                d[key] = [value[i] for i in keep]
            elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):  # per-layer dicts
                d[key] = {new: value[k] for k in value for new, old in enumerate(keep) if int(k) == old}
    heads = next((d[k] for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(d.get(k), int)), None)
    for key in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads"):
        if isinstance(d.get(key), int):
            d[key] = 4 if d[key] == heads else (1 if d[key] == 1 else 2)
    for key, size in _SIZE.items():
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool) and d[key] > 0:
            d[key] = size
    if isinstance(d.get("qk_rope_head_dim"), int):  # multi-head latent attention: RoPE on qk_rope_head_dim
        if "head_dim" in d:
            d["head_dim"] = d["qk_rope_head_dim"]
        for key in ("qk_head_dim", "swa_head_dim"):
            if isinstance(d.get(key), int):
                d[key] = d["qk_rope_head_dim"] + (d.get("qk_nope_head_dim") or 0)
    experts = [k for k in _EXPERT_COUNTS if isinstance(d.get(k), int)]
    top_k = [k for k in _EXPERT_TOP_K if isinstance(d.get(k), int)]
    for key in _EXPERT_TOP_K if experts else ():  # e.g. DeepSeek-V2's default num_experts_per_tok=None
        if key in d and d[key] is None:
            d[key] = 2
    for key in _EXPERT_COUNTS if top_k else ():
        if key in d and d[key] is None:
            d[key] = 4
    for key in _ZERO:
        if isinstance(d.get(key), int):
            d[key] = 0
    for key in _MIN_ONE:
        if isinstance(d.get(key), int):
            d[key] = min(d[key], 1)
    _shrink_mamba2(d)
    if "initializer_range" in d:
        d["initializer_range"] = 0.1  # larger than real models: greedy choices are not near-ties
    for key in _TOKEN_KEYS if not nested else ():
        if key in d:
            d[key] = None  # no early stop: the greedy runs compare full length
    vocab = d.get("vocab_size")
    if isinstance(vocab, int):  # other special ids (image tokens, ...) must stay inside the vocabulary
        ids = [v for k, v in d.items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)]
        if ids and max(ids) >= vocab:
            d["vocab_size"] = max(ids) + 1
    return d


# A Mamba2 mixer's config keys per family: (heads, head dim, state size, groups, expand, inner width)
_MAMBA2_KEYS = (
    ("num_heads", "head_dim", "state_size", "n_groups", "expand", None),  # mamba2
    ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_expand", "mamba_d_ssm"),
    ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", None, None),  # nemotron_h
    ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_expand", None),  # zamba2
)


def _shrink_mamba2(d: dict) -> None:
    """A Mamba2 mixer shrunk consistently (its width, ``expand x hidden`` or the family's own
    inner width, must be heads x head dim): 8 heads of 16 over hidden 64 x 2, state 16, 2 groups."""
    for heads, head_dim, state, groups, expand, width in _MAMBA2_KEYS:
        if not all(isinstance(d.get(k), int) for k in (heads, head_dim, state)):
            continue
        d.update({heads: 8, head_dim: 16, state: 16})
        if isinstance(d.get(groups), int):
            d[groups] = min(d[groups], 2)
        if expand in d:
            d[expand] = 2
        if isinstance(d.get(width), int):
            d[width] = 128
        return


# Sizes a config's __post_init__ derives from others: to_dict() writes them out and from_dict() sets
# them back over the derived ones, so a shrunk config would keep the default's (Zamba2's attention
# width, twice the hidden size: 5120).
_DERIVED = {
    "zamba2": ("attention_hidden_size", "attention_head_dim", "mamba_headdim", "kv_channels", "num_query_groups"),
}


def tiny_config(model_type: str):
    """The tiny config of one family: its config class's defaults, shrunk."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    tiny = shrink(config_class().to_dict())
    for key in _DERIVED.get(model_type, ()):
        tiny.pop(key, None)
    for _ in range(len(_TOKEN_KEYS)):
        try:
            return config_class.from_dict(tiny)
        except Exception as e:  # a config class that wants its special token ids set: give the first ids
            field = next((k for k in _TOKEN_KEYS if f"'{k}' expected int" in str(e)), None)
            if field is None:
                raise
            tiny[field] = {"eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0}[field]
    return config_class.from_dict(tiny)


def _default_config_dict(model_type: str, architecture: str) -> dict:
    """The family's default config as ``config.json`` would hold it (for refusals read from it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    config.architectures = [architecture]
    return json.loads(config.to_json_string())


# ------------------------------------------------------------------------------- classification


def not_decoder_only(model_type: str, config) -> str | None:
    """Why a family the causal-LM mapping lists is not a decoder-only LM, or None."""
    from transformers.models.auto import modeling_auto as auto

    if getattr(config, "is_encoder_decoder", False) or model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "the decoder of an encoder-decoder model (cross-attention to an encoder)"
    if model_type in getattr(auto, "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", {}):
        return "the decoder of a speech encoder-decoder model"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or hasattr(config, "add_cross_attention"):
        return "an encoder (masked-LM) family that transformers can also run as a decoder"
    return None


@dataclass
class Result:
    model_type: str
    architecture: str
    result: str  # one of RESULTS
    detail: str = ""  # the refusal message, the failing stage and error, ...
    seconds: float = 0.0
    verified: bool = False  # in kvforge's verified table
    carried: bool = False  # copied from an earlier run's cache (--carry), not re-run

    @property
    def line(self) -> str:
        return f"{self.result}: {self.detail}" if self.detail and self.result != TOKEN_EXACT else self.result


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {line}"[:300]


# --------------------------------------------------------------------------------------- worker


def survey_one(model_type: str, work: Path) -> Result:
    """Build, compile and check one family (runs inside the worker subprocess)."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    started = time.perf_counter()

    def done(result: str, detail: str = "", verified: bool = False) -> Result:
        return Result(model_type, architecture, result, detail, round(time.perf_counter() - started, 1), verified)

    from kvforge.compile.load import resolve_spec
    from kvforge.graphs.architectures import UnsupportedArchitectureError

    def refused_from_config(config_dict: dict) -> str | None:
        """kvforge's refusal of the family from its config alone, if any: it says more than a
        failure of transformers on the tiny model."""
        try:
            resolve_spec(config_dict)
        except UnsupportedArchitectureError as refusal:
            return str(refusal).split("; kvforge verifies")[0]
        except Exception:
            return None
        return None

    try:
        config = tiny_config(model_type)
    except Exception as e:
        try:
            refusal = refused_from_config(_default_config_dict(model_type, architecture))
        except Exception:
            refusal = None
        return done(REFUSED, refusal) if refusal else done(HF_FAILS, f"config: {_first_line(e)}")
    why = not_decoder_only(model_type, config)
    if why:
        return done(NOT_DECODER, why)

    from kvforge.compile import compile_model

    config.architectures = [architecture]
    model_dir, out = work / "model", work / "out"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        torch.manual_seed(0)
        model = getattr(transformers, architecture)(config).eval()
        _randomize_zero_matrices(model)
        model.save_pretrained(model_dir)
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([PROMPT]),
                attention_mask=torch.ones(1, len(PROMPT), dtype=torch.int64),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected = generated[0, len(PROMPT) :].tolist()
    except Exception as e:
        refusal = refused_from_config(json.loads(config.to_json_string()))
        return done(REFUSED, refusal) if refusal else done(HF_FAILS, _first_line(e))
    del model, reference

    stage = ["resolve"]

    def progress(message: str) -> None:
        for key, name in (
            ("loading", "load"),
            ("exporting", "export"),
            ("writing graphs", "weights"),
            ("quantizing", "quantize"),
            ("optimizing", "optimize"),
            ("parity", "parity"),
            ("manifest", "manifest"),
        ):
            if key in message:
                stage[0] = name
        print(f"[kvforge] {message}", file=sys.stderr, flush=True)

    try:
        manifest = compile_model(
            model_dir, out, max_batch=1, max_seq=COMPILE_MAX_SEQ, score_graph=False, progress=progress
        )
    except UnsupportedArchitectureError as e:
        traceback.print_exc()  # the log keeps the cause (an export error's whole chain)
        message = str(e).split("; kvforge verifies")[0]
        if stage[0] in ("resolve", "load"):
            return done(REFUSED, message)
        return done(FAILED, f"{stage[0]}: {message}")
    except Exception as e:
        traceback.print_exc()
        return done(FAILED, f"{stage[0]}: {_first_line(e)}")
    verified = bool(manifest.parity.get("verified_family"))
    if not manifest.parity.get("greedy_match"):
        worst = max(manifest.parity["prefill_max_abs_diff"], manifest.parity["decode_max_abs_diff"])
        return done(FAILED, f"parity: greedy tokens differ (max |logit diff| {worst:.3g})", verified)

    from kvforge.runtime import Engine

    try:
        with Engine.load(out) as engine:
            ours = engine.generate([PROMPT], max_new_tokens=NEW_TOKENS)[0].token_ids
    except Exception as e:
        traceback.print_exc()
        return done(FAILED, f"engine: {_first_line(e)}", verified)
    eos = set(manifest.generation.get("eos_token_ids") or [])
    stop = next((i for i, t in enumerate(expected) if t in eos), None)
    expected = expected if stop is None else expected[: stop + 1]  # the engine stops at an eos id
    if list(ours) != expected:
        return done(FAILED, f"engine: greedy tokens {list(ours)} != transformers {expected}", verified)
    shutil.rmtree(work, ignore_errors=True)  # keep failures' directories for a look, not successes'
    return done(TOKEN_EXACT, f"max |logit diff| {manifest.parity['decode_max_abs_diff']:.2g}", verified)


def _randomize_zero_matrices(model) -> None:
    """Fill weight matrices that a family's init leaves at zero (MoE router gates, for one) with
    small random values: with all-zero router logits every expert ties, and transformers and ONNX
    Runtime break top-k ties differently, a difference no trained model has."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.1)


def _worker(model_type: str, work: Path, result_file: Path) -> None:
    result = survey_one(model_type, work / model_type)
    result_file.write_text(json.dumps(asdict(result), indent=1))


# ----------------------------------------------------------------------------------------- runner


def families() -> list[tuple[str, str]]:
    """(model_type, architecture) of every causal-LM family transformers maps, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def _stage_from_log(log: Path) -> str:
    stage = "start"
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("[kvforge] ["):
                stage = line.split("] ", 2)[-1][:60]
    return stage


def run_family(
    model_type: str, architecture: str, work: Path, timeout: float, fresh: bool = False, carry: Path | None = None
) -> Result:
    """One family in a subprocess (cached in ``work/results/<model_type>.json``). With ``carry``,
    a family without a result in ``work`` takes the one cached in ``carry`` instead (marked)."""
    results = work / "results"
    results.mkdir(parents=True, exist_ok=True)
    result_file = results / f"{model_type}.json"
    if result_file.exists() and not fresh:
        return Result(**json.loads(result_file.read_text()))
    if carry is not None and (carry / "results" / f"{model_type}.json").exists():
        result = Result(**json.loads((carry / "results" / f"{model_type}.json").read_text()))
        result.carried = True
        return result
    log = work / "logs" / f"{model_type}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", model_type, "--work", str(work)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    with log.open("w") as sink:
        try:
            proc = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, env=env)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = round(time.perf_counter() - started, 1)
    if result_file.exists() and code == 0:
        result = Result(**json.loads(result_file.read_text()))
        result.seconds = seconds  # the subprocess's wall time, imports included
        result_file.write_text(json.dumps(asdict(result), indent=1))
        return result
    if code is None:
        result = Result(model_type, architecture, FAILED, f"timeout after {timeout:.0f} s at: {_stage_from_log(log)}")
    else:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or [""]
        result = Result(model_type, architecture, FAILED, f"worker crashed (exit {code}): {tail[0][:200]}")
    result.seconds = seconds
    result_file.write_text(json.dumps(asdict(result), indent=1))
    return result


def survey(
    only: list[str] | None,
    work: Path,
    timeout: float,
    jobs: int = 1,
    fresh: bool = False,
    say=print,
    carry: Path | None = None,
) -> list[Result]:
    """Run (or read from the cache) every selected family; returns the results in family order."""
    from concurrent.futures import ThreadPoolExecutor

    selected = [(t, a) for t, a in families() if only is None or t in only]
    unknown = sorted(set(only or ()) - {t for t, _ in selected})
    if unknown:
        raise SystemExit(f"unknown model types {unknown}: not in transformers' causal-LM mapping")

    def one(item: tuple[str, str]) -> Result:
        result = run_family(*item, work, timeout, fresh, carry)
        mark = " (carried)" if result.carried else ""
        say(f"{result.model_type:28s} {result.seconds:6.1f}s  {result.line[:150]}{mark}")
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, selected))


def counts(results: list[Result]) -> dict[str, int]:
    return {name: sum(r.result == name for r in results) for name in RESULTS}


def _versions() -> dict[str, str]:
    import onnxruntime
    import torch
    import transformers

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def _cell(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # the exporter colours its messages
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(
    results: list[Result],
    command: str,
    versions: dict[str, str],
    wall: float | None,
    load: str = "",
    before: dict | None = None,
) -> str:
    """docs/coverage.md. ``before``: an earlier run's ``--json`` (its counts and per-family results
    get a column of their own)."""
    from kvforge.graphs.architectures import ARCHITECTURES

    total = counts(results)
    earlier = {r["model_type"]: r for r in (before or {}).get("results", [])}
    carried = sum(r.carried for r in results)
    count_rows = (
        [f"| {name} | {before['counts'].get(name, 0)} | {n} |" for name, n in total.items()]
        if before
        else [f"| {name} | {n} |" for name, n in total.items()]
    )
    count_head = ["| result | before | now |", "|---|---|---|"] if before else ["| result | families |", "|---|---|"]
    total_row = f"| **total** | {len(earlier)} | {len(results)} |" if before else f"| **total** | {len(results)} |"
    lines = [
        "# Coverage: the causal-LM families transformers ships",
        "",
        "Generated by `benchmarks/coverage.py` (do not edit by hand). Every `model_type` of transformers'",
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` gets a tiny random model (its config class's defaults shrunk:",
        f"{LAYERS} layers or one per layer type, hidden 64, 4 heads of 16, vocabulary 256, 4 experts), compiled",
        "with `kvforge.compile.compile_model` (CPU target, max_seq 32) and checked twice against transformers:",
        "compile's parity record (`greedy_match`) and",
        f"{NEW_TOKENS} greedy tokens of `kvforge.runtime.Engine` against transformers' `generate` on an",
        f"{len(PROMPT)}-token prompt.",
        "",
        "- **token-exact**: compiled, and both checks give transformers' tokens.",
        "- **refused**: compile refuses the family before export and says what is missing.",
        "- **failed**: compile or a check failed at the named stage.",
        "- **not a decoder-only LM**: the mapping lists it, but it is an encoder or the decoder half of an",
        "  encoder-decoder model.",
        "- **transformers itself fails**: transformers cannot build or run the tiny model.",
        "",
        "## Counts",
        "",
        *count_head,
        *count_rows,
        total_row,
        "",
        ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"Command: `{command}`"
        + (
            f" (this invocation: {wall / 60:.0f} min on 2 shared cores{load}; results cached in `--work` by "
            "earlier invocations are read, not re-run)."
            if wall
            else "."
        ),
        f"The families' own runs (subprocess wall time, summed): {sum(r.seconds for r in results) / 60:.0f} min.",
    ]
    if before:
        lines += [
            "",
            f"*before*: the same survey on kvforge before the generic-path fixes of issue #14 "
            f"({before.get('note', 'see its command')}).",
        ]
    if carried:
        lines += [
            "",
            f"{carried} results marked *(carried)* were not re-run with this code: they are copied from "
            "the earlier run's cache (`--carry`).",
        ]
    lines += [
        "",
        "## Supported families",
        "",
        "| model_type | architecture | result | notes |" + (" before |" if before else ""),
        "|---|---|---|---|" + ("---|" if before else ""),
    ]
    for r in results:
        verified = " (verified table)" if r.architecture in ARCHITECTURES else ""
        detail = "" if r.result == TOKEN_EXACT else r.detail
        note = (r.detail if r.result == TOKEN_EXACT else "") + verified + (" *(carried)*" if r.carried else "")
        result = f"{r.result}: {_cell(detail)}" if detail else r.result
        row = f"| {r.model_type} | {r.architecture} | {result} | {_cell(note)} |"
        if before:
            row += f" {earlier[r.model_type]['result'] if r.model_type in earlier else ''} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


README = ROOT / "README.md"
_COUNTS_START, _COUNTS_END = "<!-- coverage-counts: written by benchmarks/coverage.py -->", "<!-- /coverage-counts -->"


def update_readme(readme: Path, results: list[Result], versions: dict[str, str]) -> None:
    """Rewrite the counts between the README's coverage markers (the README links the table)."""
    text = readme.read_text()
    if _COUNTS_START not in text or _COUNTS_END not in text:
        return
    total = counts(results)
    line = (
        f"With transformers {versions['transformers']}: of {len(results)} model types, "
        + ", ".join(f"**{n}** {name}" for name, n in total.items())
        + "."
    )
    head, rest = text.split(_COUNTS_START, 1)
    tail = rest.split(_COUNTS_END, 1)[1]
    readme.write_text(f"{head}{_COUNTS_START}\n{line}\n{_COUNTS_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--sample", action="store_true", help=f"the fixed CI sample: {', '.join(SAMPLE)}")
    parser.add_argument("--jobs", type=int, default=1, help="families at once (default 1)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per family (default 180)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="cache of per-family results and logs")
    parser.add_argument("--fresh", action="store_true", help="ignore cached results")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, help="markdown output (default docs/coverage.md for a full run)")
    parser.add_argument("--carry", type=Path, help="an earlier --work: families not run here take its results")
    parser.add_argument("--before", type=Path, help="an earlier run's --json, shown beside this run in the doc")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.work, args.work / "results" / f"{args.worker}.json")
        return 0
    only = list(SAMPLE) if args.sample else (args.only.split(",") if args.only else None)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    results = survey(only, args.work, args.timeout, args.jobs, args.fresh, carry=args.carry)
    wall = time.perf_counter() - started
    load = f", load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    total = counts(results)
    print(" / ".join(f"{k} {v}" for k, v in total.items()), f"(total {len(results)})")
    command = "python benchmarks/coverage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = args.doc or (DEFAULT_DOC if only is None else None)
    if doc:
        before = json.loads(args.before.read_text()) if args.before else None
        doc.write_text(markdown(results, command.strip(), _versions(), wall, load, before))
        if doc == DEFAULT_DOC:
            update_readme(README, results, _versions())
        print(f"wrote {doc}")
    if args.json:
        payload = {
            "versions": _versions(),
            "command": command.strip(),
            "counts": total,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
