"""The one exception the command line turns into a one-line message and a non-zero exit status."""

from __future__ import annotations

from ..errors import ModelpatchError

__all__ = ["CliError", "EXIT_FAILED_CHECK", "EXIT_USAGE"]

EXIT_FAILED_CHECK = 1
"""Exit status when the command ran but at least one check failed."""

EXIT_USAGE = 2
"""Exit status for a bad argument, a missing folder, a bad patches file, an unknown recipe."""


class CliError(ModelpatchError):
    """A user-facing error: ``str(error)`` is printed as ``modelpatch: error: <message>``, no traceback."""
