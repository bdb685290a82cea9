"""`--config FILE.toml`: any flag of a command from a TOML file; flags on the command line win.

Keys are the flags' names without the leading dashes, with `-` or `_`
(``batch-size = 128``, ``lr_schedule = "step"``). A switch takes a boolean, under either its
own name (``no-progress = true``) or what it sets (``progress = false``). Values go through
the same checks as on the command line; a bad key or value is one line naming the file, the
key and the value.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dptrain.errors import UsageError


def read_toml(path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise UsageError(f"--config {path}: reading TOML needs Python 3.11 or the tomli "
                             "package (pip install tomli)") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except (OSError, IsADirectoryError) as exc:
        raise UsageError(f"--config {path}: cannot read ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: not valid TOML ({exc})") from None


def _switches(action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def config_defaults(parser: argparse.ArgumentParser, path, table: dict) -> dict:
    """dest -> value for the parser, from a TOML table, each value checked as its flag is."""
    by_dest, by_flag = {}, {}
    for action in parser._actions:
        if action.dest in ("help", "version", "config") or not action.option_strings:
            continue
        by_dest[action.dest] = action
        for flag in action.option_strings:
            by_flag[flag.lstrip("-").replace("-", "_")] = action
    values = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        action = by_flag.get(name) or by_dest.get(name)
        where = f"--config {path}: {key} = {value!r}"
        if action is None:
            raise UsageError(f"--config {path}: unknown key {key!r} (keys are the flags of "
                             f"{parser.prog}, without the dashes)")
        if _switches(action):
            if not isinstance(value, bool):
                raise UsageError(f"{where}: expected true or false")
            # Under the flag's own name (no-progress), true means "as if given"; under what
            # it sets (progress), the value itself.
            if name != action.dest:
                value = action.const if value else action.default
            values[action.dest] = value
            continue
        if isinstance(value, bool) and action.nargs == "?":  # augment = true: the bare flag
            values[action.dest] = action.const if value else action.default
            continue
        if isinstance(value, (bool, dict, list)):
            raise UsageError(f"{where}: expected a single {'value' if action.type else 'string'}")
        if action.type is not None:
            try:
                value = action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                raise UsageError(f"{where}: {exc}") from None
        elif not isinstance(value, str):
            raise UsageError(f"{where}: expected a string")
        if action.choices is not None and value not in action.choices:
            raise UsageError(f"{where}: choose one of {', '.join(map(str, action.choices))}")
        values[action.dest] = value
    return values


def apply_config(parser: argparse.ArgumentParser, argv) -> str | None:
    """Read ``--config FILE`` from argv, if given, and make its values the parser's defaults
    (so flags given on the command line override them). Returns the file's path."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return None
    path = Path(known.config)
    parser.set_defaults(**config_defaults(parser, path, read_toml(path)))
    return str(path)
