"""Shared fixtures. Test data lives in ``../shared`` beside the repository (never copied in)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_CANDIDATES = (Path(__file__).resolve().parents[2] / "shared", Path("/work/shared"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="device of the tests that take one (tests/test_device.py): cpu "
                          "(default, CI) or cuda (skipped with a reason where CUDA is absent)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--device") == "cuda":  # before any cuBLAS handle exists
        # deterministic cuBLAS, for the bit-for-bit comparisons of test_device.py
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest):
    """The torch device ``--device`` names; ``cuda`` without CUDA skips the test, saying why."""
    import torch

    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"--device cuda: CUDA is not available (torch {torch.__version__}, "
                    f"built for CUDA {torch.version.cuda or 'none'})")
    return torch.device(name)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The ``shared/`` folder beside the repository; the test is skipped when it is absent."""
    for candidate in SHARED_CANDIDATES:
        if candidate.is_dir():
            return candidate
    pytest.skip("../shared (test data beside the repository) is not available")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test runs torch on one thread: tiny models gain nothing from a second one, a busy
    machine makes two threads spin, and results do not depend on the core count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def theta_kernel_built():
    """Build (or load) the C++ Θ kernel once, before any test: the default Pattention impl uses
    it, and a first-use compile must not land inside one test's time."""
    from tokenformer.nn.kernels import cpu_theta as kernels

    kernels.available()


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory) -> Path:
    """A small byte-level prepared dataset: the first 200 kB of the embedded corpus."""
    from tokenformer.data.corpus import kjv_text
    from tokenformer.data.prepare import prepare

    root = tmp_path_factory.mktemp("data")
    (root / "text.txt").write_text(kjv_text()[:200_000])
    prepare(root / "text.txt", "bytes", root / "ds", val_fraction=0.1, progress=False)
    return root / "ds"
