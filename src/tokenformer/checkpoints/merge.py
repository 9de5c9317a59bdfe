"""Merging token adapters into their base: a plain model folder, its tokenizer kept
(``tokenformer merge``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io.outputs import check_output
from ..ops import adapters as ad
from .folders import derived_model_folder


def merge_checkpoint(base: str, adapters: list[str], out: str | Path, *,
                     overwrite: bool = False) -> dict[str, Any]:
    """Load ``base`` and ``adapters`` (stacked in order), write the merged plain model
    (``overwrite``: replacing an earlier ``merge``'s output)."""
    out = Path(out)
    check_output(out, [base, *adapters], command="merge", overwrite=overwrite)
    model = ad.load_adapted(base, adapters)
    merged = ad.merge(model)
    with derived_model_folder(out, Path(base), command="merge", overwrite=overwrite) as tmp:
        merged.save(tmp)
    return {"out": str(out), "adapters": ad.active_adapters(model),
            "parameters": merged.num_parameters(), "config": merged.config.to_dict()}
