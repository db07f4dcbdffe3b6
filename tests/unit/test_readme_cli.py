"""The README's CLI table names every option `jobplane dev --help` shows."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from jobplane.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _dev_options() -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    dev = commands.choices["dev"]
    return {
        option
        for action in dev._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def test_the_dev_row_names_every_dev_option() -> None:
    row = next(
        line for line in README.read_text().splitlines() if line.startswith("| `jobplane dev ")
    )
    command = re.split(r"(?<!\\)\|", row)[1]  # the first cell (`\|` is a pipe within it)
    missing = sorted(o for o in _dev_options() if o not in command)
    assert not missing, f"README's `jobplane dev` row lacks {missing}"
