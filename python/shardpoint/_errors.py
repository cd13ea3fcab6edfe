"""The one place where errors of the native core become Python exceptions.

Every function of the package that calls into ``shardpoint._core`` does so inside
:func:`translated`, which turns a ``_core.StatusError`` into the exception class of its code.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error; ``code`` is the status code name (e.g. "DATA_LOSS")."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (or no requested key) where one was expected (NOT_FOUND)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already at the path and overwrite was not asked (ALREADY_EXISTS)."""


class CheckpointCorruptError(CheckpointError):
    """Stored bytes fail their checks: truncated file, bad checksum, bad header (DATA_LOSS)."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint needs a newer reader, or a precondition of the format fails (FAILED_PRECONDITION)."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """The caller's state or options are inconsistent: shape, dtype, layout, key (INVALID_ARGUMENT)."""


_CLASS_BY_CODE: dict[str, type[CheckpointError]] = {
    "NOT_FOUND": CheckpointNotFoundError,
    "ALREADY_EXISTS": CheckpointExistsError,
    "DATA_LOSS": CheckpointCorruptError,
    "FAILED_PRECONDITION": CheckpointVersionError,
    "INVALID_ARGUMENT": CheckpointArgumentError,
    "OUT_OF_RANGE": CheckpointArgumentError,
}


def error_for(code: str, message: str) -> CheckpointError:
    """Returns the exception instance for a status ``code`` and ``message``."""
    return _CLASS_BY_CODE.get(code, CheckpointError)(message, code)


def code_of(error: BaseException) -> str:
    """The status code that best describes ``error`` (used to forward a Python failure to all ranks)."""
    if isinstance(error, CheckpointError):
        return error.code
    code = getattr(error, "code", None)
    if isinstance(code, str):
        return code
    if isinstance(error, (ValueError, TypeError, KeyError)):
        return "INVALID_ARGUMENT"
    if isinstance(error, FileNotFoundError):
        return "NOT_FOUND"
    return "INTERNAL"


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Runs the body, re-raising ``_core.StatusError`` as the matching :class:`CheckpointError`."""
    from . import _core

    try:
        yield
    except _core.StatusError as e:
        raise error_for(e.code, e.message) from None
