"""The libraries' chatter that says nothing to a kvforge user, held back while compile runs them.

Compile reports its own progress (``[kvforge] [i/n] ...`` on stderr, or nothing with ``-q``); what
the libraries under it print on their own is noise there:

* transformers draws a ``Loading weights`` progress bar on every ``from_pretrained``;
* the ONNX exporter warns, once per process, that torchvision is not installed and skips its ops
  (``torchvision::nms``, ...), which no language model uses.

Each is held back by the library's own switch (transformers' progress-bar setting, the standard
``logging`` level of the exporter's registry logger), only for the block, and put back as it was:
a user's own settings outside compile are left alone. Warnings that concern the model (a refusal,
a parity failure) are kvforge's and are not touched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# The logger of torch.onnx's op registry, which warns about every torchvision op it skips.
EXPORTER_REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def no_loading_bar() -> Iterator[None]:
    """transformers' progress bars (``Loading weights``) off for the block."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Records of logger ``name`` below ``level`` dropped for the block (its level restored after)."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(max(level, before))
    try:
        yield
    finally:
        logger.setLevel(before)
