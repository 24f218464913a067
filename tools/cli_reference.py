"""The CLI reference, generated from the CLI's own argparse parser so it cannot drift.

Input: :func:`kvforge.tools.cli.build_parser`. Output: ``docs/cli-reference.md``: per command, its
usage line, its description and a table of its options with their help, in the parser's order.
Deterministic: argparse's usage is formatted at a fixed width, whatever the terminal's.

    python -m kvforge.tools.cli_reference            # rewrite docs/cli-reference.md (`make docs`)
    python -m kvforge.tools.cli_reference --check    # exit 1 when the file differs
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvforge.tools.cli import build_parser

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli-reference.md"
WIDTH = 100


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
    if action.option_strings and action.nargs != 0:
        metavar = action.metavar or action.dest.upper()
        names += f" `{' '.join(metavar) if isinstance(metavar, tuple) else metavar}`"
    help_text = (action.help or "") % {"default": action.default, "prog": "kvforge"} if action.help else ""
    if action.choices and not isinstance(action.choices, dict):
        help_text += f" (one of: {', '.join(map(str, action.choices))})"
    return f"| {names} | {_cell(help_text)} |"


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def render(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or build_parser()
    lines = [
        "# CLI reference (generated)",
        "",
        "Generated from `kvforge`'s argparse parser by `python -m kvforge.tools.cli_reference` (`make docs`);",
        "do not edit by hand: a test fails when this file and the parser differ. What each command does,",
        "in prose: [cli.md](cli.md).",
        "",
    ]
    for name, sub in _subparsers(parser).items():
        lines += [f"## `kvforge {name}`", "", "```text", _usage(sub), "```", ""]
        if sub.description:
            lines += [" ".join(sub.description.split()), ""]
        rows = [
            _option_row(a)
            for a in sub._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS
        ]
        if rows:
            lines += ["| argument | what |", "|---|---|", *rows, ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 when the file differs from the parser")
    args.add_argument("--out", type=Path, default=DOC)
    opts = args.parse_args(argv)
    os.environ["COLUMNS"] = str(WIDTH)  # argparse reads it for descriptions it wraps itself
    text = render()
    if opts.check:
        same = opts.out.exists() and opts.out.read_text() == text
        print(f"{opts.out} is {'current' if same else 'out of date: run `make docs`'}")
        return 0 if same else 1
    opts.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
