"""What every command does with a user's mistake: one line that names it, and exit 2.

argparse prints its usage before the error and accepts a prefix of an option
(``--num-block`` for ``--num-blocks``); ``CommandLine`` prints the error alone, with
where the options are listed, and takes options only as spelled. The argument types
here check what argparse cannot: a directory that exists, an address with its scheme.
"""

from __future__ import annotations

import argparse
import urllib.parse
from pathlib import Path
from typing import NoReturn

USAGE_ERROR = 2
"""The exit status of a user's mistake, as argparse's own."""


class CommandLine(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (its subcommands' too)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def existing_directory(text: str) -> Path:
    """An argument type: a directory that is there."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return path


def http_url(text: str) -> str:
    """An argument type: an http or https address with its host."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        bare = text.split("://")[-1]
        raise argparse.ArgumentTypeError(f"{text} is not an http:// or https:// address; did you mean http://{bare}?")
    return text

