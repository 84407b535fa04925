"""Entry point of the ``adaptrain`` command: one sub-command per module of this package.

Each sub-command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported lazily, so ``adaptrain simulate`` never imports torch
and a missing optional dependency only affects its own sub-command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# (sub-command, module, one-line help). Imported only when that sub-command runs.
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("demo", "adaptrain.cli.demo", "train the character LM on 2 local replicas, autoscaled"),
    ("simulate", "adaptrain.cli.simulate", "replay a cluster workload trace under a policy"),
    ("server", "adaptrain.cli.server", "run the scheduler service for many elastic jobs"),
    ("submit", "adaptrain.cli.submit", "submit a job to the server; prints its name"),
    ("ls", "adaptrain.cli.ls", "list the server's jobs"),
    ("describe", "adaptrain.cli.describe", "a job's spec, allocation and events"),
    ("logs", "adaptrain.cli.logs", "a job's output across restarts"),
    ("cp", "adaptrain.cli.cp", "copy a file out of a job's share folder"),
    ("delete", "adaptrain.cli.delete", "cancel a job"),
    ("tensorboard", "adaptrain.cli.tensorboard", "TensorBoard over every job's logs"),
    ("ray", "adaptrain.cli.ray", "run one elastic job on a Ray cluster (ray submit)"),
]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptrain",
        description="Adaptive, elastic training on PyTorch and goodput-optimising scheduling.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, _module, help_text in SUBCOMMANDS:
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    names = {name: module for name, module, _ in SUBCOMMANDS}
    # Find the sub-command, then let its own module parse the rest.
    head, rest = [], argv
    while rest and rest[0].startswith("-"):
        head.append(rest[0])
        rest = rest[1:]
    if not rest or rest[0] not in names:
        args = parser.parse_args(head + rest[:1])
        parser.print_help()
        return 0 if not rest else 2
    common = parser.parse_args(head)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(common.verbose, 2),
        format="%(levelname)s:%(name)s:%(message)s",
    )
    module = importlib.import_module(names[rest[0]])
    sub_parser = argparse.ArgumentParser(prog=f"adaptrain {rest[0]}", description=module.HELP)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(rest[1:])
    code = int(module.run(args) or 0)
    _forget_handled_interrupts()
    return code


def _forget_handled_interrupts() -> None:
    """Clear CPython's note of a KeyboardInterrupt that the sub-command caught and handled.

    CPython (3.8 and later) notes a KeyboardInterrupt that ends any code run from source text
    (``exec`` or ``eval`` of a string, as scipy and numpy do inside some of their imports) in
    a flag that ``python -m`` reads as the interpreter exits: set, the process kills itself
    with SIGINT, whatever status the program returned, even when the interrupt was caught.
    A Ctrl-C that landed in such an import made ``python -m adaptrain simulate`` end by signal
    instead of with its status 130. Evaluating any string resets the flag as it starts, and a
    command that returned has handled every interrupt it met (one it had not would have
    propagated), so this evaluates an empty one.
    """
    exec("")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
