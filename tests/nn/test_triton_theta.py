"""The Triton Θ (``impl="triton"``, tokenformer.nn.kernels.triton_theta) without a GPU.

Triton's interpreter runs the kernels on CPU tensors, but only when ``TRITON_INTERPRET=1`` is
set before triton is imported (triton decides it for its own ``@jit`` functions, ``tl.sum``
among them, at import). This process imported triton long ago, so the device tests of the
Triton Θ (tests/test_device.py, ``-k triton``: every Θ forward and backward against float64,
n not a power of two and over one block, fp32 and bf16, zero rows, Pattention with
``impl="triton"`` in training and inference, opcheck, ``torch.compile(fullgraph=True)``) run in
a child process that sets it; on a GPU they run with ``--device cuda`` as they are.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tokenformer.nn.kernels import triton_theta
from tokenformer.nn.kernels.dispatch import select_impl
from tokenformer.nn.pattention import Pattention

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.mark.skipif(not triton_theta.available(), reason=triton_theta.unavailable_reason())
def test_device_tests_under_the_interpreter():
    """tests/test_device.py -k triton on the CPU with TRITON_INTERPRET=1: all pass, none is
    skipped (a skip would mean the kernels did not run)."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton",
         "--device", "cpu", str(ROOT / "tests" / "test_device.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 30, summary
    assert "skipped" not in summary and "failed" not in summary, summary


def test_select_impl_says_what_runs(monkeypatch):
    """The dispatch table: ``auto`` never picks Triton (unmeasured); ``triton`` runs it where it
    covers the call and falls back to ``fused`` after one warning elsewhere; reference stays
    reference; training decides fused vs reference for the PyTorch paths."""
    monkeypatch.setattr(triton_theta, "_INTERPRET", False)
    monkeypatch.setattr(triton_theta, "_state", {})
    f32, f64 = torch.float32, torch.float64
    assert select_impl("reference", CUDA, f32, "l2_norm_gelu", training=True).name == "reference"
    assert select_impl("auto", CUDA, f32, "l2_norm_gelu", training=True).name == "fused"
    assert select_impl("auto", CUDA, f32, "l2_norm_gelu", training=False).name == "reference_vt"
    assert select_impl("torch", CPU, f32, "l2_norm_gelu", training=False).name == "reference"
    assert select_impl("fused", CUDA, f32, "softmax", training=False).name == "fused"
    if triton_theta.available():
        assert select_impl("triton", CUDA, f32, "gelu_l1_norm", training=False).name == "triton"
        assert select_impl("triton", CUDA, torch.bfloat16, "gelu", training=True).name == "triton"
    with pytest.warns(RuntimeWarning, match="impl 'triton' falls back to 'fused'"):
        assert select_impl("triton", CPU, f32, "l2_norm_gelu", training=False).name == "fused"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert select_impl("triton", CUDA, f64, "l2_norm_gelu", training=True).name == "fused"
    monkeypatch.setattr(triton_theta, "_INTERPRET", True)
    if triton_theta.available():
        assert select_impl("triton", CPU, f32, "softmax", training=True).name == "triton"


def test_triton_impl_without_interpreter_computes_the_fused_result(monkeypatch):
    """On a CPU without the interpreter ``impl="triton"`` is the fused path (same numbers)."""
    monkeypatch.setattr(triton_theta, "_INTERPRET", False)
    monkeypatch.setattr(triton_theta, "_state", {"warned": True})
    torch.manual_seed(0)
    layer = Pattention(16, 12, 40, impl="triton")
    x = torch.randn(3, 16)
    y = layer(x)
    layer.impl = "fused"
    assert torch.equal(y, layer(x))


def test_block_must_be_a_power_of_two():
    if not triton_theta.available():
        pytest.skip(triton_theta.unavailable_reason())
    with pytest.raises(ValueError, match="power of two"):
        triton_theta.theta(torch.randn(2, 10), "gelu", 1.0, block=48)


class _TargetOnly:
    """A Triton driver that names a CUDA target and nothing else: enough for Triton to lower a
    kernel to TTIR (what inductor analyses) on a machine without a GPU."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")  # triton's, lowering to TTIR
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("block", [64, 512], ids=["blocks", "one-block"])
def test_inductor_finds_only_the_outputs_written(monkeypatch, block, groups):
    """What ``torch.compile`` sees of the Triton Θ ops (the triton_op form, CUDA's): traced
    through functionalization as AOTAutograd traces them, each kernel launch becomes a
    functional HOP whose ``tensors_to_clone`` are the arguments inductor's analysis of the
    kernel's TTIR finds written, which it clones before every launch unless they are fresh
    buffers. They must be the outputs alone (Θ and r forward, dS backward): an input there (the
    scores, dΘ) would be one extra pass over a [rows, n] tensor per launch. The analysis runs on
    the CPU (TTIR for a named target; no kernel runs); the kernels under the interpreter are a
    different object that torch.compile cannot trace at all, so this is checked here."""
    if not triton_theta.available() or triton_theta.interpreting():
        pytest.skip("needs triton, imported without TRITON_INTERPRET")
    import triton
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(triton.runtime.driver, "_active", _TargetOnly())
    fwd, bwd = triton_theta._ops()

    segments = (groups,) if groups > 1 else ()  # 1: the ops' default, the single-layer call

    def step(scores):
        theta, r = fwd(scores, "l2_norm_gelu", 2.0, 1e-6, block, *segments)
        return bwd(theta, scores, r, "l2_norm_gelu", 2.0, 1e-6, block, *segments)

    scores = torch.randn(5, 2 * groups * 300)[:, :groups * 300]  # rows strided
    graph = make_fx(dispatch_functionalize(step), tracing_mode="fake")(scores).graph
    launches = [node.kwargs for node in graph.nodes
                if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert [sorted(k["tensors_to_clone"]) for k in launches] == [["out_ptr", "r_ptr"],
                                                                 ["ds_ptr"]]
