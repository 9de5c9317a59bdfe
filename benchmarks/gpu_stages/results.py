"""``results.json`` (every stage run into a folder, merged: a stage run again replaces its entry)
and ``results.md`` (the same as markdown: one section and table per stage, the GPU named)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import log

from tokenformer.io.files import atomic_write_text

from .base import STAGES

RESULTS_JSON, RESULTS_MD = "results.json", "results.md"


def markdown(results: dict[str, Any]) -> str:
    """Every stage of ``results`` as a markdown section with its table, the device named; a
    lease's summary first."""
    sections = [section(results[stage]) for stage in ("lease", *STAGES) if stage in results]
    return "\n".join([header(results.get("env", {})), *sections])


def header(env: dict[str, Any]) -> str:
    return (f"# GPU results (benchmarks/gpu.py)\n\nDevice: {env.get('summary', '?')}; bf16 matmul "
            f"{env.get('bf16_matmul_tflops', float('nan')):.3g} TFLOP/s, copy "
            f"{env.get('copy_gbps', float('nan')):.3g} GB/s (measured); {env.get('cpu_count')} "
            f"CPU cores, Python {env.get('python')}\n")


def section(r: dict[str, Any], profiles: bool = True) -> str:
    """One stage's markdown section (with the training profiles, unless not ``profiles``);
    columns no row fills are left out."""
    rows = r.get("rows", [])
    columns = [c for c in r.get("columns", []) if any(row.get(c[0]) is not None for row in rows)]
    lines = [f"## GPU: {r.get('title', '?')}\n", f"Command: `{r.get('command', '?')}`  ",
             f"Device: {r.get('device', '?')}; {r.get('written', '?')}"
             + (f"; {r['seconds']:.0f} s" if r.get("seconds") is not None else "") + "\n"]
    if columns:
        lines += ["| " + " | ".join(title for _, title, _ in columns) + " |",
                  "|" + "---|" * len(columns)]
        for row in rows:
            lines.append("| " + " | ".join(
                "—" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in columns)
                + " |")
        lines.append("")
    lines += [f"* {note}" for note in r.get("notes", [])]
    for name, table in r.get("profiles", {}).items() if profiles else ():
        lines += ["", f"Profile of one step of {name}:", "", "```", table, "```"]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict[str, Any]) -> None:
    atomic_write_text(out / RESULTS_JSON, json.dumps(results, indent=1) + "\n")
    atomic_write_text(out / RESULTS_MD, markdown(results))


def load_results(out: Path) -> dict[str, Any]:
    path = out / RESULTS_JSON
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        log(f"{path} is not JSON; starting a new one")
        return {}
