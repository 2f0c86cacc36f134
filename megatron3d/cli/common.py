"""The command-line front end shared by ``pretrain_gpt.py`` and the tools in ``tools/``.

Every entry point keeps one promise: bad input exits with code 2 and one stderr line
``error: <what is wrong, the value, the fix>``, never an argparse usage block or a traceback.
``OneLineParser`` turns argparse's complaints into ``ConfigError``; ``add_int``/``add_float``
check numeric flags against a ``Range`` while parsing; ``check_output_path`` refuses an output
that cannot be written before any work starts; ``run_tool`` prints the one line.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from megatron3d.config.ranges import Range
from megatron3d.errors import ConfigError, Megatron3dError, TrainingError

COMMAND_LINE = "on the command line"


class ArgumentContainer(Protocol):
    """A parser or an argument group: what the ``add_*`` helpers add a flag to."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError instead of printing usage and exiting.

    A prefix of a flag is never taken for the flag (``allow_abbrev=False``): it is a typo, and
    ``parse`` reports it as an unknown flag with the closest known one. ``--help`` still
    prints the help and exits 0.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, exit_on_error=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"invalid command line: {message}: run with --help to see every flag")

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """``argv`` (``sys.argv[1:]`` by default) -> namespace; ConfigError for any mistake."""
        args = sys.argv[1:] if argv is None else list(argv)
        try:
            namespace, extras = self.parse_known_args(args)
        except argparse.ArgumentError as err:
            raise self._argument_error(err, args) from None
        if extras:
            raise self._unknown_argument(extras)
        return namespace

    def known_flags(self) -> set[str]:
        """Every option string this parser takes (``--foo``, ``-h``)."""
        return set(self._flags())

    def _flags(self) -> dict[str, argparse.Action]:
        """Every option string (``--foo``, ``-h``) -> its action."""
        return {flag: action for action in self._actions for flag in action.option_strings}

    def _argument_error(self, err: argparse.ArgumentError, args: list[str]) -> ConfigError:
        """argparse's complaint about a known flag (missing value, value on a switch)."""
        flag = err.argument_name or "?"
        action = self._flags().get(flag)
        after = args[args.index(flag) + 1:][:1] if flag in args else []
        if action is not None and action.nargs == 0:
            fix = f"{flag} is a switch: give it alone, with no value"
        elif after and after[0].startswith("-") and not _looks_like_flag(after[0]):
            fix = f"join a value that starts with '-' to its flag: write {flag}={after[0]}"
        else:
            fix = f"write it as '{_usage(flag, action)}'"
        return ConfigError(f"{err.message} {COMMAND_LINE} ({flag}): {fix}")

    def _unknown_argument(self, extras: list[str]) -> ConfigError:
        """The first leftover argument: an unknown flag, or a value that follows no flag."""
        first = extras[0]
        if not _looks_like_flag(first):
            return ConfigError(
                f"unexpected value {COMMAND_LINE} ({first!r}): every value must follow a flag "
                "that takes it; check how many values the flag before it takes (see --help)"
            )
        flag, _, inline = first.partition("=")
        value = inline or (extras[1] if len(extras) > 1 and not _looks_like_flag(extras[1])
                           else "")
        known = [f for f in self._flags() if f.startswith("--")]
        close = difflib.get_close_matches(flag.replace("_", "-"), known, n=1)
        hint = f"did you mean {close[0]}?" if close else "run with --help to see every flag"
        shown = f"{flag}={value}" if value else flag
        return ConfigError(f"unknown flag {COMMAND_LINE} ({shown}): {hint}")


def _usage(flag: str, action: argparse.Action | None) -> str:
    """How a flag is written, e.g. ``--lr FLOAT`` or ``--rampup-batch-size INT INT INT``."""
    if action is None:
        return f"{flag} VALUE"
    metavar = action.metavar
    if metavar is None:
        metavar = ("{" + ",".join(map(str, action.choices)) + "}" if action.choices
                   else action.dest.upper())
    nargs = action.nargs
    if nargs == "+":
        return f"{flag} {metavar} [{metavar} ...]"
    if nargs in ("*", "?"):
        return f"{flag} [{metavar}]"
    return " ".join([flag] + [str(metavar)] * (nargs if isinstance(nargs, int) else 1))


def _looks_like_flag(arg: str) -> bool:
    """``-x``/``--x`` but not a negative number such as ``-1e-3``."""
    try:
        float(arg)
    except ValueError:
        return arg.startswith("-")
    return False


class _Number:
    """An argparse ``type`` for one flag: a finite ``kind`` number inside ``bounds``.

    It raises ConfigError itself (argparse passes it through untouched), so the message can
    name the flag, the value and the range together.
    """

    def __init__(self, flag: str, kind: type[int] | type[float], bounds: Range) -> None:
        self.flag, self.kind, self.bounds = flag, kind, bounds
        noun = "a whole number" if kind is int else "a finite number"
        self.expected = f"{noun} {_words(bounds)}"

    def __call__(self, text: str) -> int | float:
        value = self._convert(text)
        if value is None or value not in self.bounds:
            raise ConfigError(f"invalid value {COMMAND_LINE} ({self.flag}={text!r}): "
                              f"expected {self.expected}")
        return value

    def _convert(self, text: str) -> int | float | None:
        """``text`` as ``kind``; None if it is not one, or is nan/inf (ints are never: a huge
        int must not reach ``math.isfinite``, which overflows on it)."""
        try:
            value = self.kind(text.strip())
        except ValueError:
            return None
        return value if self.kind is int or math.isfinite(value) else None


def _words(bounds: Range) -> str:
    return f"in {bounds}" if bounds.high is not None else str(bounds)


def add_int(container: ArgumentContainer, flag: str, bounds: Range, help: str,
            **kwargs: Any) -> None:
    """A whole-number flag; a value outside ``bounds`` is a ConfigError naming the flag."""
    _add_number(container, flag, int, bounds, help, kwargs)


def add_float(container: ArgumentContainer, flag: str, bounds: Range, help: str,
              **kwargs: Any) -> None:
    """A finite-number flag; nan, inf or a value outside ``bounds`` is a ConfigError."""
    _add_number(container, flag, float, bounds, help, kwargs)


def _add_number(container: ArgumentContainer, flag: str, kind: type[int] | type[float],
                bounds: Range, help: str, kwargs: dict[str, Any]) -> None:
    number = _Number(flag, kind, bounds)
    default = kwargs.get("default")
    shown = f" Default: {default}." if default is not None else ""
    container.add_argument(flag, type=number, metavar="INT" if kind is int else "FLOAT",
                           help=f"{help}{shown} Allowed: {bounds}.", **kwargs)


def check_output_path(path: str, flag: str, *, prefix: bool = False) -> None:
    """Refuse an output path that cannot be written, before any work: one that names a
    directory (a ``prefix`` may sit beside a directory of its name: suffixes are added), or
    whose parent is a file or cannot be created. Creates the missing parent directories."""
    if not os.path.basename(path) or (not prefix and os.path.isdir(path)):
        raise ConfigError(f"{flag} {path!r} names a directory; give a file "
                          f"{'prefix' if prefix else 'path'} in it, e.g. "
                          f"{os.path.join(path, 'out')}")
    parent = os.path.dirname(os.path.abspath(path))
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {path!r}: {existing} is a file, not a directory; give a "
                          "path under a directory")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: cannot create its directory {parent} "
                          f"({exc.strerror}); give a path under a writable directory") from None
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path!r}: directory {parent} is not writable; give a path "
                          "under a writable directory")


def run_tool(body: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """``body(argv)``, turning any Megatron3dError into one ``error:`` line and exit code 2
    (1 for a ``TrainingError``: the work went wrong, not its input), as pretrain_gpt.py does."""
    try:
        return body(argv)
    except Megatron3dError as err:
        sys.stderr.write("error: " + " ".join(str(err).splitlines()) + "\n")
        return 1 if isinstance(err, TrainingError) else 2
