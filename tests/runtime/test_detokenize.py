"""runtime/detokenize.py: streamed text equals the full decode, for every kind of tokenizer decoder.

Proves, on four tokenizers (a byte-level BPE trained in-process on non-ASCII text, a Llama-2-style
SentencePiece BPE with "▁" spaces and <0xNN> byte fallback, a T5-style Unigram with a Metaspace
decoder, and the bundled models/kvforge-tiny tokenizer): (1) for real texts (accents, CJK, Hangul,
emoji with modifiers and ZWJ, 4-byte symbols, runs of spaces), every chunk is final (no U+FFFD, each
concatenated prefix is a prefix of the result) and the concatenation equals ``decode(ids)``, with and
without special tokens in between; (2) a character split across tokens is held back ('' returned)
until its last byte arrives; (3) for 300 random id sequences per tokenizer (special ids included,
invalid UTF-8 included), ``"".join(add) + flush() == decode(ids)`` with skip_special_tokens on and off.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from kvforge.runtime import IncrementalDetokenizer, Tokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "kvforge-tiny" / "tokenizer.json"

TRAIN = [
    "The café served crème brûlée and naïve piñatas. Über straße, façade, déjà vu.",
    "日本語のテキストと中文字符，还有한국어 문장. 東京は大きい。",
    "Emoji: 😀🎉👍🏽 and flags 🇫🇷 mixed with ascii! 👩‍👩‍👧",
    "The for statement iterates over the items of any sequence. A list is a mutable sequence.",
    "Functions are defined with def and return a value. Classes bundle data and behaviour together.",
]
TEXTS = [
    "Hello world, the for statement iterates.",
    "Crème brûlée à la française — naïve façade, Ångström, Øresund.",
    "日本語の文章です。中文也可以。한국어도 됩니다.",
    "Party 🎉🎉 time 👍🏽👍🏿 family 👩‍👩‍👧 flag 🇯🇵 music 𝄞 math 𝔸𝔹 snow ☃",
    "  leading  and   inner spaces\n\nnew lines\ttabs  ",
    "a",
]


def _byte_level(out: Path) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAIN, trainer)
    tok.save(str(out))
    return out


def _sentencepiece_bpe(out: Path) -> Path:
    """Llama-2's tokenizer.json shape: "▁" spaces, BPE with byte fallback, Replace+ByteFallback+Fuse+Strip decoder."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([TRAIN[0], *TRAIN[3:]], trainer)  # no CJK/emoji pieces: those fall back to bytes
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the <0xNN> pieces are ordinary vocabulary entries, as in Llama-2
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    out.write_text(json.dumps(spec), encoding="utf-8")
    return out


def _unigram_metaspace(out: Path) -> Path:
    """T5's shape: Unigram with a Metaspace pre-tokenizer and decoder (pieces carry their leading "▁")."""
    tok = HFTokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    tok.train_from_iterator(TRAIN, trainer)
    tok.save(str(out))
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    d = tmp_path_factory.mktemp("detok")
    return {
        "byte_level": Tokenizer(_byte_level(d / "bl.json")),
        "sentencepiece_bpe": Tokenizer(_sentencepiece_bpe(d / "sp.json")),
        "unigram_metaspace": Tokenizer(_unigram_metaspace(d / "ug.json")),
        "bundled": Tokenizer(BUNDLED),
    }


NAMES = ["byte_level", "sentencepiece_bpe", "unigram_metaspace", "bundled"]


def stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    chunks = [det.add(i) for i in ids]
    chunks.append(det.flush())
    return chunks, "".join(chunks)


@pytest.mark.parametrize("name", NAMES)
def test_real_texts_stream_to_exactly_the_decode(tokenizers, name):
    tok = tokenizers[name]
    special = sorted(tok.special_ids)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        with_special = ids[: len(ids) // 2] + special[:1] + ids[len(ids) // 2 :] + special[-1:]
        for seq in (ids, with_special):
            for skip in (True, False):
                want = tok.decode(seq, skip_special_tokens=skip)
                chunks, got = stream(tok, seq, skip)
                assert got == want, f"{name}: {got!r} != decode {want!r}"
                if "\ufffd" not in want:
                    assert not any("\ufffd" in c for c in chunks), f"{name}: a chunk held U+FFFD: {chunks}"
                prefix = ""
                for c in chunks:
                    prefix += c
                    assert want.startswith(prefix)


def test_split_character_is_held_until_complete(tokenizers):
    tok = tokenizers["byte_level"]
    ids = tok.encode("a𝄞b", add_special_tokens=False)  # 𝄞 is 4 bytes, not a learned merge
    det = IncrementalDetokenizer(tok)
    out = [det.add(i) for i in ids]
    assert out[0] == "a" and out[-1] == "b"
    assert len(out) > 3 and out[1:-2] == [""] * (len(out) - 3) and out[-2] == "𝄞", out
    # SentencePiece byte fallback: 日 is three <0xNN> pieces; shown once the run of byte pieces ends.
    sp = tokenizers["sentencepiece_bpe"]
    ids = sp.encode("日 The", add_special_tokens=False)
    pieces = [sp._tok.id_to_token(i) for i in ids]
    assert pieces[1:4] == ["<0xE6>", "<0x97>", "<0xA5>"], pieces
    det = IncrementalDetokenizer(sp)
    out = [det.add(i) for i in ids]
    assert out[:4] == ["", "", "", ""] and "".join(out) + det.flush() == "日 The"


def test_metaspace_space_is_emitted_with_the_next_word(tokenizers):
    tok = tokenizers["unigram_metaspace"]
    ids = tok.encode("The list is a sequence", add_special_tokens=False)
    chunks, got = stream(tok, ids)
    assert got == "The list is a sequence" == tok.decode(ids)
    assert next(c for c in chunks if c).startswith("T")  # the first "▁" is stripped, as decode does
    assert any(c.startswith(" ") for c in chunks[1:])  # later pieces bring their space


@pytest.mark.parametrize("name", NAMES)
def test_random_ids_concatenate_to_decode(tokenizers, name):
    tok = tokenizers[name]
    rng = random.Random(name)
    vocab = min(tok.vocab_size, 4096)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.5
        want = tok.decode(ids, skip_special_tokens=skip)
        assert stream(tok, ids, skip)[1] == want, f"{name} ids={ids} skip={skip}"
