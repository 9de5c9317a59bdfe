"""Reads the state an experiment saved to resume from, with one error line when it is damaged."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import CheckpointError

RERUN_RECORDED = "delete it to rerun the runs it records"


def damaged(path: str | Path, detail: str, redo: str = RERUN_RECORDED) -> CheckpointError:
    """The one error line for a file an experiment saved to resume from that cannot be used:
    the file, what is wrong with it and what to do (``redo``: deleting it costs only the work it
    records, which a rerun then repeats)."""
    return CheckpointError(f"{path} is damaged ({detail}); {redo}")


def read_saved_json(path: str | Path, valid: Callable[[Any], bool],
                    redo: str = RERUN_RECORDED) -> Any:
    """The JSON an experiment saved at ``path``; :func:`damaged` when it is unreadable, not JSON
    (a crash of another writer, a disk error, an edit) or not what ``valid`` accepts."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise damaged(path, f"not readable JSON: {str(exc).splitlines()[0]}", redo) from None
    if not valid(data):
        raise damaged(path, "not the record this experiment writes", redo)
    return data


def is_mapping_of(data: Any, key: str, kind: type = dict) -> bool:
    """``data`` is a dict whose ``key`` holds a dict (or ``kind``) of dicts."""
    inner = data.get(key) if isinstance(data, dict) else None
    return isinstance(inner, kind) and all(isinstance(v, dict) for v in (
        inner.values() if isinstance(inner, dict) else inner))
