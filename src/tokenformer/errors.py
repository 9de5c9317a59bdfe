"""User-facing errors. The CLI prints their message as one line and exits non-zero.

Imports nothing of the package: every layer raises these.
"""

import errno
import sys
import types
import warnings


class TokenFormerError(Exception):
    """Base class of every error whose message is meant for the user, not a traceback."""


class ConfigError(TokenFormerError, ValueError):
    """A configuration value is malformed or inconsistent."""


class CheckpointError(TokenFormerError):
    """A checkpoint is missing, corrupt, or does not match the model."""


class DataError(TokenFormerError):
    """Input data is empty, undecodable, too short or does not match the model."""


class GrowthError(TokenFormerError, ValueError):
    """A requested growth is impossible (shrinking, or growing what tokens cannot grow)."""


class TokenFormerWarning(RuntimeWarning):
    """A warning whose message is meant for the user (a documented fallback, e.g. a Θ kernel
    that cannot run here): the CLI prints it as one ``warning:`` line, without the source line
    Python's warnings add; in Python it is the RuntimeWarning it always was."""


class TokenFormerDeprecationWarning(TokenFormerWarning, DeprecationWarning):
    """An old spelling that still works (``--grow-at ...,strategy=``, ``grow --strategy``,
    ``register_strategy``: a growth recipe's old name): the CLI prints it once, as one
    ``warning:`` line; in Python it is a DeprecationWarning (shown, as every one, in
    ``__main__`` and under pytest)."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name when it has none): what a one-line
    error quotes of a library's multi-line exception."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _in_package(frame: types.FrameType) -> bool:
    """A frame of the package: its module's (code a dataclass generates for the package has the
    file ``<string>`` but the package's module)."""
    module = frame.f_globals.get("__name__", "")
    return module == __package__ or module.startswith(f"{__package__}.")


def warn_deprecated(message: str) -> None:
    """A :class:`TokenFormerDeprecationWarning` blamed on the first caller outside the package.
    Python shows a DeprecationWarning only where it is blamed on ``__main__``, so the line named
    must be the user's, however deep in the package the old spelling was read."""
    frame, level = sys._getframe(0), 1
    while frame is not None and _in_package(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, TokenFormerDeprecationWarning, stacklevel=level)


class PathError(CheckpointError, DataError, ConfigError):
    """An input path is missing or is not a regular file (a directory, FIFO, device, socket), or
    is a symbolic link inside a model, adapter, dataset or run folder
    (:func:`tokenformer.io.paths.regular_file`). Also a CheckpointError, DataError and ConfigError:
    what callers caught for a missing checkpoint, dataset or config before."""


class OutputError(DataError, ConfigError):
    """An output would lose data: it is (or holds, or lies in) an input, it exists and
    ``--overwrite`` was not given, or it is a folder the command did not write. (Also a DataError
    and a ConfigError: what callers caught for an existing output before.)"""


class DiskFullError(TokenFormerError):
    """A write failed for lack of space (:func:`is_disk_full`); the message names the file, what
    was kept, and to free space and rerun (:func:`tokenformer.io.files.stop_on_disk_full`)."""


class DivergedError(TokenFormerError):
    """The training loss became non-finite. Experiments that probe learning rates catch it and
    record the run as diverged; everywhere else it is one error line."""


def is_disk_full(exc: BaseException) -> bool:
    """True for a write that failed for lack of space: ``OSError(ENOSPC)`` (or EDQUOT), torch's
    zip writer, which reports it as ``RuntimeError: ... unexpected pos ...`` / ``file write
    failed``, safetensors' ``SafetensorError: ... (os error 28)``, or tokenizers' plain
    ``Exception: No space left on device (os error 28)`` (``tokenizer.json`` of a conversion)."""
    codes = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    if isinstance(exc, OSError):
        return exc.errno in codes
    text = str(exc)
    # the Rust libraries (safetensors, tokenizers) give the OS error in words only
    if type(exc).__name__ in ("SafetensorError", "Exception"):
        return any(f"(os error {code})" in text for code in codes)
    return isinstance(exc, RuntimeError) and ("unexpected pos" in text
                                              or "file write failed" in text)
