"""compile/quiet.py holds back the libraries' chatter only for its block: transformers' progress
bars are off inside ``no_loading_bar`` and back as they were after (on or off), and a logger under
``quiet_logger`` drops records below ERROR inside and keeps its own level after."""

from __future__ import annotations

import logging

from transformers.utils import logging as hf_logging

from kvforge.compile import quiet


def test_no_loading_bar_restores_the_users_setting():
    assert hf_logging.is_progress_bar_enabled()
    with quiet.no_loading_bar():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a user who turned them off keeps them off
    try:
        with quiet.no_loading_bar():
            pass
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def test_quiet_logger_drops_warnings_in_the_block_only(caplog):
    name = "kvforge.tests.quiet"
    logger = logging.getLogger(name)
    with caplog.at_level(logging.INFO, logger=name):
        with quiet.quiet_logger(name):
            logger.warning("held back")
            logger.error("still shown")
        assert logger.level == logging.INFO  # caplog's level, restored by quiet_logger
        logger.warning("after")
    assert [r.getMessage() for r in caplog.records] == ["still shown", "after"]
