"""Errors that reach users: one sentence naming the file, node or option, and exit status 2."""


class ParastreamError(Exception):
    """A problem with the user's input or environment.

    The CLI prints ``str(err)`` on one line and exits with ``exit_code``; a
    traceback only appears with ``--debug``.
    """

    exit_code = 2


class BackendUnavailable(ParastreamError):
    """The chosen engine backend cannot run here (missing package or no GPU)."""


class VerificationError(ParastreamError):
    """Outputs of the deployment do not match the reference within tolerance."""

    exit_code = 1
