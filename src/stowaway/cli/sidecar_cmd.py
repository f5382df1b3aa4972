"""``stowaway sidecar``: the daemon that runs next to the training container."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil

from stowaway import sidecar_settings
from stowaway.cli.errors import CommandError
from stowaway.sidecar.config import SidecarConfig
from stowaway.sidecar.server import Sidecar, SidecarError


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "sidecar", help="run the saver sidecar daemon",
        description="Serve ranks on a Unix socket, persist their slots to storage and commit checkpoints.",
    )
    for setting in sidecar_settings.ALL:
        setting.add_to(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--remove-dirs-on-exit", action="store_true",
                        help="remove --shm-dir and the socket's directory once stopped; for `stowaway run`, which "
                        "made both for this run alone (in a pod the slots must outlive a restarted sidecar)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    values = vars(args)
    # A setting left without a value (the node's name) takes SidecarConfig's default, which its help describes.
    given = {s.name: values[s.name] for s in sidecar_settings.ALL if values[s.name] is not None}
    # The sidecar's own uid and root may always connect; --allow-uid adds to them.
    given[sidecar_settings.ALLOWED_UIDS.name] = frozenset({os.getuid(), 0, *args.allowed_uids})
    try:
        config = SidecarConfig(**given)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    sidecar = Sidecar(config)
    runner = asyncio.Runner()
    try:
        runner.run(sidecar.serve())
    except SidecarError as exc:
        runner.close()
        raise CommandError(str(exc)) from None
    finally:
        if args.remove_dirs_on_exit:
            shutil.rmtree(config.shm_dir, ignore_errors=True)
            shutil.rmtree(config.socket_path.parent, ignore_errors=True)
    if sidecar.abandoned_work:
        # Closing the runner, or leaving the interpreter, joins the persist threads, which may sit in a write
        # to slow storage for far longer than the grace period; Kubernetes would SIGKILL us anyway.
        logging.shutdown()
        os._exit(0)
    runner.close()
    return 0
