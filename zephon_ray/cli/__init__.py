"""The ``zephon-ray`` command (entry point ``zephon_ray.cli:main``; ``python -m zephon_ray.cli`` runs it too).

    zephon-ray digest RECIPE --steps A:B [--via local|service|dataset] [--producers M]
    zephon-ray show RECIPE --step S [--plot out.png]
    zephon-ray validate RECIPE | fingerprint RECIPE
    zephon-ray audit CHECKPOINT_OR_LEDGER [--ledger DIR] [--recipe R [--dataset DIR | --service NAME]]
    zephon-ray ledger compact DIR   (merge a ledger's files into a bounded number)
    zephon-ray inspect STATE_DIR [--json]   (a service's durable state, offline: no Ray)
    zephon-ray corpus OUT_DIR
    zephon-ray bench RECIPE [--steps N] [--via local|service|both]   (this node's production rate)
    zephon-ray serve | status | stop | rescale M | release CONSUMER      (the Ray data service)
    zephon-ray add-phase PHASE --start-step S --weight SRC=W ... --name SERVICE   (a running service's schedule)
    zephon-ray pretokenize | materialize ...   (Ray Data jobs)

RECIPE is a path, or the bare name of a packaged recipe (``tiny``, ``elastic``, ``demo``, ``mixture``).

The parts: data.py (the recipe, batch, dataset and job commands), service.py (the data service's commands and
``digest --via service``), exit_codes.py (the one error mapping). Each command returns its exit code or raises; only
``main`` turns an exception into output, through :func:`zephon_ray.cli.exit_codes.run_command`: bad input is one line
``zephon-ray: error: ...`` naming what is wrong and exit 2, never a traceback; a bug keeps its traceback. Progress bars (tqdm, on stderr) appear only on a
terminal.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from zephon_ray.cli.exit_codes import PROG, USER_ERROR_EXIT, run_command

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (the usage is one ``--help`` away), exit 2 like any user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USER_ERROR_EXIT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from zephon_ray.cli import data, service

    parser = _Parser(prog=PROG, description="Deterministic, step-keyed global batches for training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    data.add_batch_commands(sub)  # digest, show, corpus, bench
    data.add_recipe_commands(sub)  # validate, fingerprint, audit, ledger, inspect
    service.add_service_commands(sub)  # serve, status, stop, rescale, add-phase, release
    data.add_job_commands(sub)  # pretokenize, materialize
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: its exit code (0, or 1 for an audit with findings; 130 after Ctrl-C); a user error raises
    ``SystemExit(2)`` after its one line on stderr (zephon_ray/cli/exit_codes.py)."""
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)
