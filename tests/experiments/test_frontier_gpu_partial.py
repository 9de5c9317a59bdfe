"""The partial `gpu-code` run committed in docs/results/frontier-gpu resumes in the next lease only
while the preset's settings are the ones it started with: `scale` refuses a folder whose
fingerprint differs ("holds another experiment"), so a changed field (even the prose of
``expected_hours``) would orphan the GPU minutes already spent (docs/results/frontier-gpu.md)."""

import dataclasses
import json
from pathlib import Path

from tokenformer.experiments.common.arms import fingerprint
from tokenformer.experiments.frontier.presets import PRESETS

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "results" / "frontier-gpu"


def test_gpu_code_preset_still_resumes_the_committed_partial_run() -> None:
    marker = json.loads((FOLDER / "experiment.json").read_text())
    # what scale computes on the device: the recorded data, device and threads, today's preset
    settings = {**marker["settings"], "preset": dataclasses.asdict(PRESETS["gpu-code"])}
    assert fingerprint(settings) == marker["fingerprint"]

