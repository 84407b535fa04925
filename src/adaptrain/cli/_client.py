"""What the job commands share: finding the server and its token, and reporting errors."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PORT = 8765


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        metavar="URL",
        help=f"the server (default: $ADAPTRAIN_SERVER, else http://127.0.0.1:{DEFAULT_PORT})",
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help="the server's token (or $ADAPTRAIN_TOKEN)"
    )


def read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {path!r}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"--token-file {path!r} is empty")
    return token


def client(args: argparse.Namespace):
    from adaptrain import env
    from adaptrain.service.client import Client

    url = args.server or env.server_url() or f"http://127.0.0.1:{DEFAULT_PORT}"
    token = read_token_file(args.token_file) if args.token_file else env.server_token()
    return Client(url, token)


def fail(command: str, message: str, code: int = 1) -> int:
    print(f"adaptrain {command}: {message}", file=sys.stderr)
    return code


def isatty() -> bool:
    try:
        return os.isatty(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return False
