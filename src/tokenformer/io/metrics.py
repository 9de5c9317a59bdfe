"""A training run's ``metrics.jsonl``: written as the run goes, cut back on resume, read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from .files import atomic_write_text
from .paths import has_regular_file


class MetricsLog:
    """``metrics.jsonl``: one JSON record per line (``type`` = train, eval or grow), plus optional
    TensorBoard scalars."""

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("tensorboard logging needs the tensorboard package: "
                                  "pip install 'tokenformer[tensorboard]'") from None
            self._tb = SummaryWriter(str(tensorboard_dir))

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{record['type']}/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    @staticmethod
    def truncate(path: str | Path, step: int) -> None:
        """Keep the records up to ``step`` (a resumed run rewrites what came after its
        checkpoint; a growth at ``step`` itself came after it too); a line cut short by a kill
        is dropped."""
        path = Path(path)
        if path.is_file():
            atomic_write_text(path, "".join(MetricsLog.kept(path, step)))

    @staticmethod
    def kept(path: str | Path, step: int) -> list[str]:
        """The lines :meth:`truncate` keeps; CheckpointError names a malformed line (a line cut
        short by a kill is expected only at the end, and dropped)."""
        path = Path(path)
        if not has_regular_file(path, folder=path.parent):
            return []
        kept = []
        lines = _read_lines(path)
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # the line a kill cut short
                    continue
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
                raise CheckpointError(f"{path} line {number} is not a metrics record (a JSON "
                                      f"object with an integer step): fix or delete that line, "
                                      f"then resume again")
            # A growth at step s runs after s steps, so after the checkpoint of step s: the run
            # resumed from that checkpoint grows again and writes the record again.
            last = step - 1 if record.get("type") == "grow" else step
            if record.get("step", 0) <= last:
                kept.append(line + "\n")
        return kept


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not has_regular_file(path, folder=run_dir):
        raise CheckpointError(f"{run_dir} has no metrics.jsonl: not a training run directory")
    records = []
    for line in _read_lines(path):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {exc.start}): not a metrics "
                              f"log written by tokenformer") from None
