"""Parse, without running, the commands that docs name inline: ``python tests/doc_parse_check.py`` reads a JSON list
of argv lists on stdin and prints a JSON object {command: error} of those that do not parse.

An argv is ``["zephon-ray", ...]`` (parsed by ``zephon_ray.cli.build_parser()``) or ``["python", SCRIPT, ...]``:
SCRIPT runs as ``__main__`` with ``argparse.ArgumentParser.parse_args`` replaced by one that parses and then stops
the script, so nothing past its argument parsing runs. One process for every command: imports are paid once.

Limits: a script that does work before it parses its arguments does that work here; one that parses ``sys.argv``
by hand (no argparse) would run, so the caller sends only scripts that use argparse.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys


class _Parsed(Exception):
    pass


def _check(argv: list[str]) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[0] == "zephon-ray":
                from zephon_ray.cli import build_parser

                build_parser().parse_args(argv[1:])
                return None
            sys.argv = argv[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))  # as `python SCRIPT` sets it
            try:
                runpy.run_path(argv[1], run_name="__main__")
            finally:
                sys.path.pop(0)
    except _Parsed:
        return None
    except SystemExit as exc:
        if exc.code in (0, None):  # --help
            return None
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    except Exception as exc:  # noqa: BLE001 - reported per command, not raised
        return f"{type(exc).__name__}: {exc}"
    return "the script never parsed its arguments"


def main() -> None:
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    failures = {}
    for argv in json.load(sys.stdin):
        error = _check(argv)
        if error:
            failures[" ".join(argv)] = error
    sys.stdout.write(json.dumps(failures))


if __name__ == "__main__":
    main()
