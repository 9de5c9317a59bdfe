"""The C++ Θ kernel (tokenformer.kernels, ``impl="kernel"``) against the float64 reference.

The kernel computes in float32 whatever the storage dtype, with its own erf (the
Abramowitz–Stegun form, |error| < 1.5e-7) and exponential: its results must match the float64
truth to fp32 accuracy (no worse than 4x the fp32 reference path's own error), and under bf16
autocast be within bf16 tolerance and no worse than the reference path's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fused import (
    inputs,
    max_rel,
    norm_rel,
    peak_memory_vs_mlp,
    reference,
    value_and_grads,
)

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.nn.kernels import cpu_theta as kernels
from tokenformer.nn.kernels.fused import fused_pattention
from tokenformer.nn.pattention import THETA_VARIANTS, Pattention, set_pattention_impl


def kernel_pattention(x, k, v, norm, scale, eps):
    return fused_pattention(x, k, v, norm, scale, eps, kernel=True)


def test_kernel_builds_where_a_compiler_exists():
    """Where a C++ compiler is installed the kernel must build: otherwise every test below would
    skip and a broken kernel would go unnoticed."""
    if shutil.which("c++") is None or kernels.unavailable_reason().startswith("disabled"):
        pytest.skip("no C++ compiler, or TOKENFORMER_KERNELS=0")
    assert kernels.available(), kernels.unavailable_reason()


needs_kernel = pytest.mark.skipif(not kernels.available(),
                                  reason=f"Θ kernel unavailable: {kernels.unavailable_reason()}")


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 9), d=st.integers(2, 24), n=st.integers(2, 100), d_out=st.integers(1, 16),
       scale_factor=st.sampled_from([1.0, 0.5, 1.7]), eps=st.sampled_from([0.0, 1e-3]),
       seed=st.integers(0, 2**16))
def test_kernel_matches_float64_reference(L, d, n, d_out, scale_factor, eps, seed):
    """Forward and the gradients wrt X, K, V in fp32, for row lengths n that are and are not
    multiples of the vector width (the masked tails), held scales and eps > 0. (n = 1 makes the
    normalised score constant: dX is then rounding noise around 0, which no relative comparison
    can judge.)"""
    x, k, v, gy = inputs(seed, (L, d), n, d_out)
    scale = math.sqrt(n) * scale_factor
    truth = value_and_grads(reference, x, k, v, gy, "l2_norm_gelu", scale, eps)
    f32 = (x.float(), k.float(), v.float(), gy)
    ours = value_and_grads(kernel_pattention, *f32, "l2_norm_gelu", scale, eps)
    ref32 = value_and_grads(reference, *f32, "l2_norm_gelu", scale, eps)
    for name, a, r, b in zip(("y", "dx", "dk", "dv"), ours, ref32, truth, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        err, err_ref = norm_rel(a, b), norm_rel(r, b)
        assert err <= 2e-5 + 4 * err_ref, (name, err, err_ref)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reduced_precision(dtype):
    """Under bf16 / fp16 autocast the kernel reads and writes the low-precision scores and
    computes in float32: within tolerance of the float64 truth, no worse than the reference."""
    x, k, v, gy = inputs(2, (3, 40, 64), 101, 48)  # n = 101: a masked tail in every row
    scale = math.sqrt(101)
    truth = value_and_grads(reference, x, k, v, gy, "l2_norm_gelu", scale, 0.0)
    results = {}
    for impl, fn in (("reference", reference), ("kernel", kernel_pattention)):
        with torch.autocast("cpu", dtype=dtype):
            results[impl] = value_and_grads(fn, x.float(), k.float(), v.float(), gy,
                                            "l2_norm_gelu", scale, 0.0)
    assert results["kernel"][0].dtype == dtype
    for name, f, r, t in zip(("y", "dx", "dk", "dv"), results["kernel"], results["reference"],
                             truth, strict=True):
        err_f, err_r = max_rel(f, t), max_rel(r, t)
        assert err_f < 3e-2, (name, err_f)
        assert err_f <= 1.5 * err_r + 4e-3, (name, err_f, err_r)


@needs_kernel
def test_kernel_ops_directly():
    """theta_forward gives Θ and the row norms; theta_backward turns (dΘ, S) into (Θ, dS) in place
    and bumps S's version; an all-zero row with eps > 0 gives Θ = 0 and the reference's
    subgradient."""
    g = torch.Generator().manual_seed(4)
    s64 = torch.randn(7, 45, dtype=torch.float64, generator=g)
    s64[3] = 0
    scale, eps = 5.0, 1e-2
    s = s64.float()
    theta, norms = kernels.theta_forward(s, scale, eps)
    assert norms.dtype == torch.float32 and norms.shape == (7,)
    torch.testing.assert_close(norms.double(), torch.linalg.vector_norm(s64, dim=-1))
    s_ref = s64.clone().requires_grad_()
    theta_ref = torch.nn.functional.gelu(
        s_ref / (torch.linalg.vector_norm(s_ref, dim=-1, keepdim=True) + eps) * scale)
    torch.testing.assert_close(theta.double(), theta_ref.detach(), rtol=1e-5, atol=1e-6)
    assert (theta[3] == 0).all()
    d_theta = torch.randn(7, 45, dtype=torch.float64, generator=g)
    (grad_ref,) = torch.autograd.grad(theta_ref, s_ref, d_theta)
    grad, version = d_theta.float(), s._version
    theta_again, grad_s = kernels.theta_backward(grad, s, norms, scale, eps)
    assert theta_again.data_ptr() == grad.data_ptr() and grad_s.data_ptr() == s.data_ptr()
    assert s._version > version
    torch.testing.assert_close(grad_s.double(), grad_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theta_again, theta, rtol=0, atol=0)


@needs_kernel
def test_second_backward_through_a_kernel_graph_is_refused():
    """The backward reuses the saved scores' memory: a retained graph cannot be replayed, and
    autograd says so instead of returning wrong gradients."""
    layer = Pattention(8, 8, 16, impl="kernel")
    y = layer(torch.randn(5, 8)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@needs_kernel
def test_kernel_impl_falls_back_where_it_does_not_apply():
    """float64, and the other Θ variants, run the PyTorch fused path (exact in float64)."""
    x, k, v, gy = inputs(5, (2, 4, 10), 12, 6)
    for norm in ("l2_norm_gelu", "softmax"):
        truth = value_and_grads(reference, x, k, v, gy, norm, 3.0, 0.0)
        for a, b in zip(value_and_grads(kernel_pattention, x, k, v, gy, norm, 3.0, 0.0), truth,
                        strict=True):
            assert max_rel(a, b) < 1e-12


def default_pattention(x, k, v, norm, scale, eps):
    """A Pattention with every setting at its default (impl="auto") holding K and V."""
    layer = Pattention(k.shape[1], v.shape[1], k.shape[0], norm, scale=scale, eps=eps,
                       dtype=k.dtype)
    return torch.func.functional_call(layer, {"key_param_tokens": k, "value_param_tokens": v},
                                      (x,))


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the kernel's forward ran (a list that grows by one per call)."""
    calls = []
    forward = kernels.theta_forward
    monkeypatch.setattr(kernels, "theta_forward",
                        lambda *a: calls.append(1) or forward(*a))
    return calls


@pytest.mark.parametrize("norm", THETA_VARIANTS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_default_impl_matches_float64_reference(norm, precision, kernel_calls):
    """The default (auto) path, training and inference, on every Θ variant: within the
    tolerances the fused and kernel paths are held to against the float64 truth; it runs the
    kernel exactly where the kernel covers the variant and is available."""
    x, k, v, gy = inputs(2, (3, 40, 64), 96, 48)  # test_fused's bf16 case, the same tolerances
    scale = math.sqrt(96) if "l2" in norm else 96.0
    truth = value_and_grads(reference, x, k, v, gy, norm, scale, 1e-6)
    f32 = (x.float(), k.float(), v.float(), gy)
    context = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
               else contextlib.nullcontext())
    with context:
        ours = value_and_grads(default_pattention, *f32, norm, scale, 1e-6)
        ref = value_and_grads(reference, *f32, norm, scale, 1e-6)
        with torch.no_grad():
            inferred = default_pattention(*f32[:3], norm, scale, 1e-6)
    for name, a, r, b in zip(("y", "dx", "dk", "dv"), ours, ref, truth, strict=True):
        if precision == "fp32":
            assert norm_rel(a, b) <= 2e-5 + 4 * norm_rel(r, b), name
        else:
            assert max_rel(a, b) < 3e-2 and max_rel(a, b) <= 1.5 * max_rel(r, b) + 4e-3, name
    tol = 2e-5 if precision == "fp32" else 3e-2
    assert norm_rel(inferred, truth[0]) <= tol + 4 * norm_rel(ref[0], truth[0])
    assert len(kernel_calls) == (2 if norm == "l2_norm_gelu" and kernels.available() else 0)


def test_auto_without_a_kernel_runs_fused_silently(monkeypatch, caplog, kernel_calls):
    """A machine without a compiler: the default impl gives fused's result (training) and the
    reference's (inference), no warning, one debug line."""
    monkeypatch.setattr(kernels, "_state", {"ok": False, "reason": "could not build: no c++"})
    x, k, v, _ = inputs(6, (5, 8), 16, 4, dtype=torch.float32)
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger=kernels.__name__):
        warnings.simplefilter("error")
        trained = value_and_grads(default_pattention, x, k, v, torch.ones(5, 4), "l2_norm_gelu",
                                  4.0, 0.0)
        with torch.no_grad():
            inferred = default_pattention(x, k, v, "l2_norm_gelu", 4.0, 0.0)
    torch.testing.assert_close(trained[0], fused_pattention(x, k, v, "l2_norm_gelu", 4.0),
                               rtol=0, atol=0)
    torch.testing.assert_close(inferred, reference(x, k, v, "l2_norm_gelu", 4.0, 0.0),
                               rtol=0, atol=0)
    assert kernel_calls == []
    notes = [r for r in caplog.records if "could not build" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.DEBUG


def test_kernel_impl_without_a_kernel_infers_with_fused(monkeypatch):
    """impl="kernel" on a machine without the kernel: fused in training and inference alike."""
    monkeypatch.setattr(kernels, "_state", {"ok": False, "reason": "could not build: no c++"})
    layer = Pattention(8, 4, 16, impl="kernel")
    x = torch.randn(5, 8)
    with pytest.warns(RuntimeWarning, match="falls back to 'fused'"), torch.no_grad():
        y = layer(x)
    with torch.no_grad():
        expected = fused_pattention(x, layer.key_param_tokens, layer.value_param_tokens,
                                    "l2_norm_gelu", layer.scale)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_missing_compiler_in_a_fresh_process(tmp_path, compiler):
    """No working compiler and an empty extension cache (a fresh machine): a tiny LM trains one
    step and generates with the defaults, without a warning."""
    code = textwrap.dedent("""
        import warnings, torch
        warnings.simplefilter("error")
        from tokenformer import TokenFormerConfig, TokenFormerLM
        from tokenformer.nn.kernels import cpu_theta as kernels
        model = TokenFormerLM(TokenFormerConfig.from_name("tiny"))
        ids = torch.randint(0, 100, (2, 12))
        model(ids, labels=ids).loss.backward()
        model.generate(ids[:, :4], 3)
        assert not kernels.available()
        print(kernels.unavailable_reason())
    """)
    cxx = str(tmp_path / "no-such-compiler") if compiler == "missing" else shutil.which("false")
    env = {**os.environ, "CXX": cxx,
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "could not build" in proc.stdout


def test_first_call_inside_fullgraph_compile_in_a_fresh_process():
    """A fresh process whose first Pattention call is inside torch.compile(fullgraph=True) on the
    CPU (an HF user's compiled forward): the kernel's first-use check cannot be traced, so that
    graph runs the PyTorch path instead of failing on a graph break; it equals the eager model.
    (Dynamo decides the graph break; ``aot_eager`` spares inductor's C++ build.)"""
    code = textwrap.dedent("""
        import torch
        from tokenformer import TokenFormerConfig, TokenFormerLM
        from tokenformer.nn.kernels import cpu_theta
        torch.manual_seed(0)
        model = TokenFormerLM(TokenFormerConfig.from_name("tiny")).eval()
        ids = torch.randint(0, 100, (2, 12))
        with torch.no_grad():
            compiled = torch.compile(model, fullgraph=True, dynamic=False,
                                     backend="aot_eager")(ids).logits
            assert "ok" not in cpu_theta._state  # undecided: the graph did not build
            eager = model(ids).logits
        assert (compiled - eager).abs().max().item() < 1e-4, (compiled - eager).abs().max()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_unavailable_kernel_warns_once_and_uses_fused(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {"ok": False, "reason": "could not build: no c++"})
    x, k, v, _ = inputs(6, (5, 8), 16, 4, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="falls back to 'fused': could not build"):
        y = kernel_pattention(x, k, v, "l2_norm_gelu", 4.0, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_pattention(x, k, v, "l2_norm_gelu", 4.0, 0.0)
    torch.testing.assert_close(y, fused_pattention(x, k, v, "l2_norm_gelu", 4.0), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="unavailable: could not build"):
        kernels.theta_forward(x @ k.t(), 4.0, 0.0)


@needs_kernel
def test_tiny_lm_with_kernel_compiles_to_one_graph():
    """torch.compile traces the kernel's operators (fake implementations) in one graph, and the
    compiled model's loss and gradients are the eager model's. (Eager against the float64 model:
    test_fused.py::test_tiny_lm_fused_equals_reference.) ``aot_eager``: the operators' fake
    implementations and autograd formulas are what AOTAutograd traces; inductor only calls them
    as extern kernels (benchmarks/compile.py times inductor on the CPU)."""
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name("tiny")
    model = TokenFormerLM(config)
    set_pattention_impl(model, "kernel")
    ids = torch.randint(0, config.vocab_size, (2, 24))
    explained = torch._dynamo.explain(model)(ids, labels=ids)
    assert explained.graph_break_count == 0, explained.break_reasons

    def loss_and_grads(forward):
        model.zero_grad()
        loss = forward(ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    compiled_model = torch.compile(model, backend="aot_eager")
    eager, compiled = loss_and_grads(model), loss_and_grads(compiled_model)
    assert abs(eager[0] - compiled[0]) < 1e-5
    for name, grad in eager[1].items():
        assert norm_rel(compiled[1][name], grad) < 1e-4, name


@needs_kernel
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kernel_peak_memory_below_gelu_mlp(precision):
    """Issue 8's memory target: the kernel path keeps S and the row norms and its backward
    allocates nothing scores-sized, so its peak is below the MLP's."""
    ours, mlp, scores_bytes = peak_memory_vs_mlp(precision, "kernel")
    assert ours <= mlp - 0.25 * scores_bytes, (ours, mlp)


# Run in a child process: one process can load only one build of the tokenformer_kernels ops.
_OTHER_ISA_CHECK = textwrap.dedent("""
    import sys, torch
    from unittest import mock
    from tokenformer.nn.kernels import cpu_theta as kernels
    from tokenformer.nn.pattention import theta
    with mock.patch.object(kernels, "isa", lambda: sys.argv[1]), \\
            mock.patch.object(kernels, "_cpu_has", lambda flag: False):
        assert kernels.build_name().startswith("tokenformer_theta_" + sys.argv[1].lower() + "_")
        assert kernels.available(), kernels.unavailable_reason()
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        s64 = torch.randn(37, 101, dtype=torch.float64, generator=g).to(dtype).double()
        d_theta = torch.randn(37, 101, dtype=torch.float64, generator=g)
        s_ref = s64.clone().requires_grad_()
        theta_ref = theta(s_ref, "l2_norm_gelu", 10.0)
        (grad_ref,) = torch.autograd.grad(theta_ref, s_ref, d_theta)
        out, norms = kernels.theta_forward(s64.to(dtype), 10.0, 0.0)
        theta_again, grad = kernels.theta_backward(d_theta.to(dtype), s64.to(dtype), norms, 10.0,
                                                   0.0)
        for got, want in ((out, theta_ref), (grad, grad_ref), (theta_again, theta_ref)):
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < tol, (sys.argv[1], dtype, err)
""")


@needs_kernel
@pytest.mark.parametrize("target", ["DEFAULT", "AVX2"])
def test_other_isa_builds_match_the_reference(target):
    """The portable build (what a CPU torch knows no vector ISA for gets) and the AVX2 build
    compute the same Θ and gradient as the reference, masked tails included (n = 101)."""
    if target == "AVX2" and kernels.isa() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU cannot run an AVX2 build")
    proc = subprocess.run([sys.executable, "-c", _OTHER_ISA_CHECK, target], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_build_kernels_command(monkeypatch, capsys):
    """`tokenformer build-kernels` reports the build it made or loaded, or says in one error
    line why there is none (exit 2)."""
    from tokenformer.cli import main

    if kernels.available():
        assert main(["build-kernels"]) == 0
        out = capsys.readouterr().out
        assert kernels.build_name() in out and out.strip().endswith(".so")
    monkeypatch.setattr(kernels, "_state", {"ok": False, "reason": "disabled by "
                                            "TOKENFORMER_KERNELS=0"})
    assert main(["build-kernels"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "TOKENFORMER_KERNELS=0" in err[0]
