"""The ``stowaway`` command: sidecar daemon, local launcher, and storage tools.

Errors end the command with one line that says what to do, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from stowaway.cli import catalog_cmds, rollback_cmd, run_cmd, sidecar_cmd
from stowaway.cli.errors import CommandError
from stowaway.errors import StowawayError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stowaway",
        description="Memory-speed checkpoints for PyTorch: sidecar daemon, local launcher, storage tools.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sidecar_cmd.add_parser(commands)
    run_cmd.add_parser(commands)
    catalog_cmds.add_parsers(commands)
    rollback_cmd.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, where a reader that went away is handled below
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`stowaway inspect ... | head`): stop quietly, as other Unix tools do, and keep
        # the interpreter's final flush of stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (CommandError, StowawayError) as exc:
        print(f"stowaway {args.command}: error: {exc}", file=sys.stderr)
        return 2
