"""The one error type a subcommand raises to end with a one-line message."""


class CommandError(Exception):
    """Printed as ``stowaway COMMAND: error: MESSAGE``; exit status 2."""
