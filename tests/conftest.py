"""Shared fixtures. Test data lives in ``../shared`` beside the repository (never copied in)."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_CANDIDATES = (Path(__file__).resolve().parents[2] / "shared", Path("/work/shared"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The ``shared/`` folder beside the repository; the test is skipped when it is absent."""
    for candidate in SHARED_CANDIDATES:
        if candidate.is_dir():
            return candidate
    pytest.skip("../shared (test data beside the repository) is not available")
