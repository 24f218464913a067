"""What ``kvforge compile MODEL`` reads: a model directory, a ``.gguf`` file or a Hugging Face Hub id.

Input: the MODEL argument (and ``--revision``). Output: a :class:`Source` whose ``model_dir`` is an
ordinary Hugging Face directory for the rest of the pipeline:

* an existing **directory** is used as it is (a local path always wins over a hub id of the same
  spelling);
* an existing **GGUF file** is converted by transformers' GGUF reader
  (:func:`kvforge.compile.gguf.convert`) into a scratch directory that lives as long as the
  ``with`` block; ``Source.gguf`` keeps the file, so compile can keep its quantized blocks;
* an **ORG/NAME** that is not a local path is resolved by ``huggingface_hub.snapshot_download``
  (config, generation config, tokenizer files, chat template, ``*.safetensors`` and their index:
  nothing else is downloaded), from the local cache when ``HF_HUB_OFFLINE`` is set or the Hub is
  unreachable. ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` and ``HF_HOME`` are read when called.

Every failure is a :class:`~kvforge.compile.load.ModelDirError` (one line: what, why, what to do).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.compile.load import ModelDirError

HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Source:
    model_dir: Path  # a Hugging Face directory
    gguf: Path | None = None  # the GGUF file model_dir was converted from
    record: dict = field(default_factory=dict)  # extra manifest.source fields: {"hub": ...} or {"gguf": ...}


def is_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and ".." not in text


@contextlib.contextmanager
def resolve(
    model: str | os.PathLike, revision: str | None, scratch: Path, say: Callable[[str], None] = lambda _: None
) -> Iterator[Source]:
    """The :class:`Source` of ``model``; a GGUF file's conversion goes to ``scratch`` (created,
    removed when the block ends). ``say`` gets a line before a conversion or a Hub look-up."""
    path = Path(model)
    if path.exists():
        if revision is not None:
            raise ModelDirError(
                f"--revision {revision} applies to Hugging Face Hub ids, but {str(path)!r} is a local path; drop it"
            )
        if path.is_file() and path.suffix.lower() == ".gguf" and not _is_gguf(path):
            raise ModelDirError(f"{str(path)!r} is named .gguf but is not a GGUF file (it lacks GGUF's magic bytes)")
        if path.is_file() and _is_gguf(path):
            say(f"converting {path} with transformers' GGUF reader (dequantized, float32)")
            with _converted(path, scratch) as source:
                yield source
            return
        yield Source(path)
        return
    if isinstance(model, str) and is_hub_id(model):
        say(f"{model} is not a local path: resolving it as a Hugging Face Hub id")
        yield from_hub(model, revision)
        return
    if revision is not None:
        raise ModelDirError(f"{str(model)!r} is neither a local path nor a Hub id ORG/NAME, so --revision has no repo")
    yield Source(path)  # read_config says the directory does not exist


def _is_gguf(path: Path) -> bool:
    from kvforge.compile.gguf import is_gguf

    return is_gguf(path)


@contextlib.contextmanager
def _converted(gguf_file: Path, scratch: Path) -> Iterator[Source]:
    from kvforge.compile import gguf
    from kvforge.graphs.manifest import sha256_file

    shutil.rmtree(scratch, ignore_errors=True)
    try:
        try:
            gguf.convert(gguf_file, scratch)
        except gguf.GGUFError as e:
            raise ModelDirError(str(e)) from e
        record = {"gguf": {"file": str(gguf_file.resolve()), "sha256": sha256_file(gguf_file)}}
        yield Source(scratch, gguf_file, record)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str | None:
    """The Hub cache as the environment names it now (None: huggingface_hub's own default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def from_hub(repo_id: str, revision: str | None = None) -> Source:
    """``repo_id``'s config, tokenizer and safetensors, from the Hub or the local cache."""
    try:
        from huggingface_hub import constants as hub_constants
        from huggingface_hub import errors as hub_errors
        from huggingface_hub import snapshot_download
    except ImportError as e:  # a dependency of transformers: absent only in a broken environment
        raise ModelDirError(f"{repo_id!r} looks like a Hub id but huggingface_hub is not installed: {e}") from e
    offline = _offline()
    cache = _cache_dir()
    where = cache or hub_constants.HF_HUB_CACHE
    at = f" at revision {revision}" if revision else ""
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=HUB_FILES,
            cache_dir=cache,
            local_files_only=offline,
        )
    except hub_errors.GatedRepoError as e:
        raise ModelDirError(
            f"{repo_id} is gated on the Hugging Face Hub: accept its terms on its page and log in (hf auth login)"
        ) from e
    except hub_errors.RepositoryNotFoundError as e:
        raise ModelDirError(
            f"{repo_id!r} is not a local path and no such model exists on the Hugging Face Hub (or it is private: "
            "log in with hf auth login); check the id or pass a model directory"
        ) from e
    except hub_errors.RevisionNotFoundError as e:
        raise ModelDirError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub; check --revision") from e
    except hub_errors.LocalEntryNotFoundError as e:
        if offline:
            raise ModelDirError(
                f"{repo_id}{at} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE is set: "
                "download it once with network access (unset HF_HUB_OFFLINE), or pass a local model directory"
            ) from e
        raise ModelDirError(
            f"cannot reach the Hugging Face Hub for {repo_id}{at} and it is not in the cache ({where}): "
            "connect to the network, or pass a local model directory"
        ) from e
    except hub_errors.HFValidationError as e:
        raise ModelDirError(f"{repo_id!r} is not a valid Hub id ({e}); pass ORG/NAME or a local directory") from e
    except (OSError, hub_errors.HfHubHTTPError) as e:
        raise ModelDirError(f"cannot download {repo_id}{at} from the Hugging Face Hub ({type(e).__name__}: {e})") from e
    commit = Path(path).name
    return Source(Path(path), None, {"hub": {"repo_id": repo_id, "revision": revision or "main", "commit": commit}})
