"""GGUF files written in-process for the tests: a tiny Llama as llama.cpp's converter lays it out.

The weights come from a random transformers Llama (:func:`tests.helpers.make_llama`'s shape), are
permuted the way ``convert_hf_to_gguf.py`` permutes q and k, and quantized with the ``gguf``
package's own ``gguf.quants.quantize``; the tokenizer is the BPE of ``tests.helpers``, stored as a
``gpt2`` GGUF vocabulary with its merges and a ChatML chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# HF name (per layer) -> GGUF name; q and k are permuted for llama.cpp's rope layout
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k permutation: [heads, 2, D/2, K] -> [heads, D/2, 2, K] row order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    path: Path,
    types: dict[str, str],
    default: str = "F32",
    tied: bool = True,
    seed: int = 0,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    vocab: int = 384,
) -> Path:
    """Write a tiny Llama to ``path`` (a ``.gguf`` file). ``types`` maps a GGUF tensor name, or a
    per-layer suffix such as ``"attn_q"`` / ``"ffn_down"``, or ``"token_embd"`` / ``"output"``, to a
    GGUF type name (``"Q4_0"``, ``"Q8_0"``, ``"Q4_1"``, ``"F16"``, ``"F32"``); other 2-D weights get
    ``default``; norms are F32. The weights are scaled so that greedy decoding is not degenerate."""
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads = 4, 2
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    tensors: dict[str, np.ndarray] = {"token_embd.weight": state["model.embed_tokens.weight"]}
    for i in range(layers):
        for hf, name in LAYER_TENSORS.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if name == "attn_q":
                w = _permute(w, heads)
            elif name == "attn_k":
                w = _permute(w, kv_heads)
            tensors[f"blk.{i}.{name}.weight"] = w
    tensors["output_norm.weight"] = state["model.norm.weight"]
    if not tied:
        tensors["output.weight"] = state["lm_head.weight"]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    _add_tokenizer(writer, path.parent, vocab)
    for name, w in tensors.items():
        qtype = "F32" if w.ndim == 1 else _type_of(name, types, default)
        kind = gguf.GGMLQuantizationType[qtype]
        if qtype == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif qtype == "F16":
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
        else:
            blocks = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
            writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _type_of(name: str, types: dict[str, str], default: str) -> str:
    if name in types:
        return types[name]
    stem = name.removesuffix(".weight")
    return types.get(stem.split(".")[-1], types.get(stem, default))


def _add_tokenizer(writer, scratch: Path, vocab: int) -> None:
    """The tests' byte-level BPE as a GGUF ``gpt2`` vocabulary (tokens by id, merges, specials)."""
    import gguf

    from tests.helpers import save_tokenizer

    folder = scratch / ".tokenizer-for-gguf"
    folder.mkdir(exist_ok=True)
    save_tokenizer(folder, vocab - 2)
    data = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    tokens = [by_id[i] for i in range(len(by_id))] + ["<|im_start|>", "<|im_end|>"]
    tokens += [f"<|pad{i}|>" for i in range(vocab - len(tokens))]
    types = [gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHATML)
