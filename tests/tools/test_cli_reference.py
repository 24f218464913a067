"""docs/cli-reference.md is what the CLI's parser says: generated from argparse
(``python -m kvforge.tools.cli_reference``, ``make docs``), so the reference cannot drift from the
options; every command and option of the parser appears in it."""

from __future__ import annotations

import argparse

from kvforge.tools import cli_reference
from kvforge.tools.cli import build_parser


def test_the_committed_reference_is_the_generated_one():
    generated = cli_reference.render()
    committed = cli_reference.DOC.read_text()
    assert committed == generated, "docs/cli-reference.md is out of date with tools/cli.py: run `make docs`"


def test_every_command_and_option_is_in_the_reference():
    text = cli_reference.render()
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"compile", "generate", "chat", "serve", "bench", "compare", "inspect", "plan", "demo"} <= set(subs)
    for name, parser in subs.items():
        assert f"## `kvforge {name}`" in text
        for action in parser._actions:
            for option in action.option_strings:
                if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                    assert f"`{option}`" in text, f"kvforge {name} {option} missing from the reference"


def test_check_mode_names_the_command_to_run(tmp_path, capsys):
    stale = tmp_path / "cli-reference.md"
    stale.write_text("old\n")
    assert cli_reference.main(["--check", "--out", str(stale)]) == 1
    assert "run `make docs`" in capsys.readouterr().out
    assert cli_reference.main(["--out", str(stale)]) == 0 and cli_reference.main(["--check", "--out", str(stale)]) == 0
