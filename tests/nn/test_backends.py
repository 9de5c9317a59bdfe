"""The Θ backends (tokenformer.nn.kernels.backends) and the rule that picks one
(tokenformer.nn.kernels.dispatch): one shape for all, one table, one place that decides, one
place that readies them; each backend's Θ and Pattention against float64 formulas."""

from __future__ import annotations

import ast
import inspect
import math
import warnings
from pathlib import Path

import pytest
import torch

from tokenformer import ConfigError
from tokenformer.nn.grouped import grouped_attend
from tokenformer.nn.kernels import cpu_theta, triton_theta
from tokenformer.nn.kernels.backends import BACKENDS, ThetaBackend
from tokenformer.nn.kernels.dispatch import (
    IMPLS,
    Impl,
    describe_impl,
    prepare_impl,
    select_impl,
)
from tokenformer.nn.pattention import (
    PATTENTION_IMPLS,
    THETA_VARIANTS,
    Pattention,
    set_pattention_impl,
)
from tokenformer.nn.theta import THETAS, ThetaVariant, register_theta, scale_n, unregister_theta

SRC = Path(__file__).resolve().parents[2] / "src" / "tokenformer"
KERNELS = SRC / "nn" / "kernels"
# Every implementation and backend name, written out (not read from the tables).
NAMES = {"auto", "fused", "reference", "kernel", "torch", "triton", "cpu_kernel", "reference_vt"}


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def theta64(scores: torch.Tensor, norm: str, scale: float, eps: float) -> torch.Tensor:
    """Θ in float64, written out (docs/architecture.md's table), row-wise over the last dim."""
    s = scores.double()
    if norm == "l2_norm_gelu":
        return gelu(s / (s.norm(dim=-1, keepdim=True) + eps) * scale)
    if norm == "softmax":
        e = s.exp()
        return e / (e.sum(dim=-1, keepdim=True) + eps) * scale
    g = gelu(s)
    if norm == "gelu":
        return g * scale
    order = 2 if norm == "gelu_l2_norm" else 1
    return g / (g.norm(p=order, dim=-1, keepdim=True) + eps) * scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------------------ the targets
def test_attend_is_one_call_to_the_chosen_backend():
    """Pattention.attend: the top-k branch, the backend select_impl picks, its pattention; no
    per-backend branches (≤ 12 lines with the signature and docstring)."""
    lines = inspect.getsource(Pattention.attend).splitlines()
    assert len(lines) <= 12, "\n".join(lines)


def _impl_name_comparisons(source: str) -> list[str]:
    """``line: code`` of every comparison in ``source`` of something named like an impl or a
    backend (``impl``, ``backend`` in its source) with a literal implementation name."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]

        def literal_names(op: ast.expr) -> set[str]:
            elements = op.elts if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [op]
            return {e.value for e in elements
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)} & NAMES

        if any(literal_names(op) for op in operands) and any(
                word in ast.unparse(op).lower() for op in operands for word in ("impl", "backend")
                if not literal_names(op)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_kernels_compares_implementation_names():
    """Which implementation runs is asked of the tables in nn/kernels (select_impl, a backend's
    methods, prepare_impl, describe_impl), never by comparing names elsewhere."""
    found = [f"{path.relative_to(SRC)}:{hit}" for path in sorted(SRC.rglob("*.py"))
             if KERNELS not in path.parents
             for hit in _impl_name_comparisons(path.read_text(encoding="utf-8"))]
    assert found == [], "\n".join(found)
    # The check sees the comparisons the modules made before the table, and no other "auto"s.
    seen = ('if cfg.pattention_impl != "auto": pass\nif backend == "triton": pass\n'
            'if cfg.compile and cfg.pattention_impl in ("auto", "kernel"): pass\n'
            'if "cpu_kernel" == self._backend(x)[0]: pass\n')
    assert len(_impl_name_comparisons(seen)) == 4
    assert _impl_name_comparisons('if spec == "auto": pass\nif name in ("torch", "x"): pass') == []


def test_backends_are_readied_in_one_place():
    """A backend's prepare() is called by dispatch.prepare_impl alone (the Triton backend's
    hands on to its module's); callers name an impl, not a backend."""
    callers = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for scope in ast.walk(tree):
            if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(scope):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "prepare"):
                    callers.add((str(path.relative_to(SRC)), scope.name))
    assert callers == {("nn/kernels/dispatch.py", "prepare_impl"),
                       ("nn/kernels/backends.py", "prepare")}


def test_every_backend_is_registered_under_its_name_and_every_rule_names_them():
    assert set(BACKENDS) == {"reference", "reference_vt", "fused", "cpu_kernel", "triton"}
    for name, backend in BACKENDS.items():
        assert isinstance(backend, ThetaBackend) and backend.name == name
        for method in ("available", "prepare", "theta", "theta_segments", "pattention"):
            assert callable(getattr(backend, method)), (name, method)
    # The impls users choose from, in the order they are listed, and each one's rule.
    assert PATTENTION_IMPLS == ("auto", "fused", "reference", "kernel", "torch", "triton")
    assert tuple(IMPLS) == PATTENTION_IMPLS
    named = {backend for rule in IMPLS.values() for backend in (*rule.training, *rule.inference)}
    assert named == set(BACKENDS)  # each rule names registered backends, each backend is used
    for rule in IMPLS.values():
        for order in (rule.training, rule.inference):
            last = BACKENDS[order[-1]]  # the last of a list covers every call
            for device in ("cpu", "cuda", "meta"):
                for dtype in (torch.float64, torch.bfloat16):
                    assert last.available(torch.device(device), dtype, "softmax", warn=True)


def old_rule(impl: str, device: torch.device, dtype: torch.dtype, norm: str, training: bool,
             kernel_built: bool, triton_runs_on_cpu: bool) -> str:
    """The dispatch as the if-chain wrote it before the table, with the kernels' coverage
    written out; auto's reference at inference re-lays out V (reference_vt). (It did so in
    training as well, for a Θ without closed forms: no longer.)"""
    variant = THETAS.get(norm)
    if impl == "reference" or variant is None or variant.fused is None:
        return "reference_vt" if impl == "auto" and not training else "reference"
    kernel = (kernel_built and variant.cpu_kernel and device.type == "cpu"
              and dtype in (torch.float32, torch.bfloat16, torch.float16))
    if impl == "triton":
        on = triton_theta.available() and (device.type == "cuda" or triton_runs_on_cpu)
        return ("triton" if on and dtype != torch.float64 and variant.triton is not None
                else "fused")
    if impl in ("auto", "kernel") and kernel:
        return "cpu_kernel"
    if training or impl in ("fused", "kernel"):
        return "fused"
    return "reference_vt" if impl == "auto" else "reference"


@pytest.mark.parametrize("kernel_built", [True, False])
@pytest.mark.parametrize("interpret", [False, True])
def test_the_rule_table_says_what_the_if_chain_said(monkeypatch, kernel_built, interpret):
    """Every impl × device × dtype × Θ (one without closed forms too) × training."""
    monkeypatch.setattr(cpu_theta, "_state", {"ok": kernel_built, "reason": "test", "warned": True,
                                              "logged": True})
    monkeypatch.setattr(triton_theta, "_INTERPRET", interpret)
    monkeypatch.setattr(triton_theta, "_state", {"warned": True})
    register_theta("relu_l1_norm", ThetaVariant(
        lambda s, scale, eps: torch.relu(s) / (torch.relu(s).sum(-1, keepdim=True) + eps) * scale,
        default_scale=scale_n, flops_per_score=4))
    try:
        for impl in PATTENTION_IMPLS:
            for device in (torch.device("cpu"), torch.device("cuda")):
                for dtype in (torch.float32, torch.bfloat16, torch.float64):
                    for norm in (*THETA_VARIANTS, "relu_l1_norm"):
                        for training in (False, True):
                            got = select_impl(impl, device, dtype, norm, training=training)
                            assert got.name == old_rule(impl, device, dtype, norm, training,
                                                        kernel_built, interpret), \
                                (impl, device, dtype, norm, training)
    finally:
        unregister_theta("relu_l1_norm")


def test_choosing_an_impl_readies_the_backend_it_names(monkeypatch):
    """Setting ``impl`` (constructor, set_pattention_impl, assignment) readies the backend a
    ``kernel``/``triton`` impl names; ``auto`` readies nothing (no C++ build on a GPU machine);
    prepare_impl (the trainer, before compiling) readies every backend the impl may run."""
    calls: list[str] = []
    for name, backend in BACKENDS.items():
        monkeypatch.setattr(backend, "prepare", lambda name=name: calls.append(name))
    layer = Pattention(8, 4, 16)
    assert calls == []
    layer.impl = "triton"
    assert calls == ["triton", "fused", "reference"]
    calls.clear()
    set_pattention_impl(torch.nn.Sequential(Pattention(8, 4, 16), Pattention(8, 4, 16)),
                        "kernel")
    assert set(calls) == {"cpu_kernel", "fused", "reference"}
    calls.clear()
    prepare_impl("auto")
    assert calls == ["cpu_kernel", "fused", "reference", "reference_vt"]


def test_a_backend_added_to_the_table_runs_every_path(monkeypatch):
    """A new backend is one object in BACKENDS and its name in an impl's rule: the layer's
    forward, top-k and the one-GEMM Q/K/V then run it (docs/architecture.md, "Adding a Θ
    backend"), with no other change."""
    calls: list[str] = []
    fused = BACKENDS["fused"]

    class Recording(type(fused)):
        name = "recording"

        def prepare(self) -> None:
            calls.append("prepare")

        def theta(self, scores, layer, training):
            calls.append("theta")
            return super().theta(scores, layer, training)

        def pattention(self, x, keys, values, layer, training):
            calls.append("pattention")
            return super().pattention(x, keys, values, layer, training)

    monkeypatch.setitem(BACKENDS, "recording", Recording())
    monkeypatch.setitem(IMPLS, "recording", Impl(training=("recording", "reference"),
                                                 inference=("recording", "reference"),
                                                 named=True))
    torch.manual_seed(0)
    layers = [Pattention(8, 4, 16, impl="recording") for _ in range(3)]
    assert calls == ["prepare"] * 3
    x = torch.randn(5, 8)
    torch.testing.assert_close(layers[0](x), fused.pattention(x, layers[0].key_param_tokens,
                                                             layers[0].value_param_tokens,
                                                             layers[0], True))
    layers[0].top_k = 4
    layers[0](x)
    grouped_attend(x, layers[1:])  # equal segments: the Protocol's theta_segments → theta
    assert calls[3:] == ["pattention", "theta", "theta"]


# ------------------------------------------------------------------------------ numerics
CPU_BACKENDS = [name for name in BACKENDS if name != "triton"]  # triton: tests/test_device.py


def backend_cases():
    for name in CPU_BACKENDS:
        for norm in THETA_VARIANTS:
            if name != "cpu_kernel" or norm == "l2_norm_gelu":  # the kernel's one Θ
                yield name, norm


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize(("name", "norm"), list(backend_cases()))
def test_each_backend_matches_float64(name, norm, training):
    """theta, theta_segments and pattention of each backend (fp32) against the float64 formula,
    with the gradients of X, K and V when autograd records; eps > 0 and a zero row included."""
    backend = BACKENDS[name]
    if not backend.available(torch.device("cpu"), torch.float32, norm, warn=False):
        pytest.skip(f"{name} is unavailable here: {cpu_theta.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    layer = Pattention(12, 7, 30, norm, eps=1e-3)
    with torch.no_grad():
        layer.key_param_tokens.copy_(torch.randn(30, 12, generator=g) * 0.5)
        layer.value_param_tokens.copy_(torch.randn(30, 7, generator=g) * 0.5)
    x = torch.randn(2, 5, 12, generator=g)
    x[0, 1] = 0.0
    keys, values = layer.key_param_tokens, layer.value_param_tokens
    truth_theta = theta64(x @ keys.t(), norm, layer.scale, layer.eps)
    with torch.set_grad_enabled(training):
        y = backend.pattention(x.requires_grad_(training), keys, values, layer, training)
        theta_ = backend.theta((x @ keys.t()).detach(), layer, training)
        wide = torch.cat([x @ keys.t(), 2 * x @ keys.t(), -x @ keys.t()], -1).reshape(10, 90)
        segments = backend.theta_segments(wide.detach(), 3, layer, training)
    assert rel(theta_, truth_theta) < 1e-5
    assert segments.shape == (3, 10, 30)
    for g_, factor in enumerate((1, 2, -1)):
        expected = theta64(factor * (x @ keys.t()), norm, layer.scale, layer.eps).reshape(10, 30)
        assert rel(segments[g_], expected) < 1e-5, g_
    x64, k64, v64 = (t.detach().double().requires_grad_() for t in (x, keys, values))
    y64 = theta64(x64 @ k64.t(), norm, layer.scale, layer.eps) @ v64
    assert rel(y, y64) < 1e-5
    if training:
        weights = torch.linspace(-1, 1, y.numel()).view_as(y)
        grads = torch.autograd.grad((y * weights).sum(), [x, keys, values])
        grads64 = torch.autograd.grad((y64 * weights.double()).sum(), [x64, k64, v64])
        for what, a, b in zip("xkv", grads, grads64, strict=True):
            assert rel(a, b) < 1e-4, what


def test_only_autos_reference_relays_v_out_for_bf16_inference():
    """reference_vt stores a bf16 layer's V column by column on the CPU (auto's inference path);
    reference (torch's) leaves the layout, so that it reproduces old results bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(3, 16).bfloat16()
    for name, strides in (("reference", (8, 1)), ("reference_vt", (1, 24))):
        layer = Pattention(16, 8, 24).bfloat16()
        with torch.no_grad():
            y = BACKENDS[name].pattention(x, layer.key_param_tokens, layer.value_param_tokens,
                                          layer, False)
        assert layer.value_param_tokens.stride() == strides, name
        expected = theta64(x @ layer.key_param_tokens.t(), "l2_norm_gelu", layer.scale, 0.0)
        assert rel(y, expected @ layer.value_param_tokens.double()) < 2e-2, name


def test_training_never_relays_v_out():
    """A Θ without fused closed forms trains on the reference under every impl, auto's included:
    a bf16 layer's V keeps its layout (the value layout is for calls autograd does not record)."""
    register_theta("relu_l1_norm", ThetaVariant(
        lambda s, scale, eps: torch.relu(s) / (torch.relu(s).sum(-1, keepdim=True) + eps) * scale,
        default_scale=scale_n, flops_per_score=4))
    try:
        layer = Pattention(16, 8, 24, "relu_l1_norm").bfloat16()
        layer(torch.randn(3, 16).bfloat16()).float().sum().backward()
        assert layer.value_param_tokens.stride() == (8, 1)
        assert layer.value_param_tokens.grad.stride() == (8, 1)
        with torch.no_grad():
            layer(torch.randn(3, 16).bfloat16())
        assert layer.value_param_tokens.stride() == (1, 24)  # inference: column by column
    finally:
        unregister_theta("relu_l1_norm")


def test_describe_impl_says_what_auto_resolves_to(monkeypatch):
    """The words a frontier run's results.json records under ``pattention_impl``."""
    monkeypatch.setattr(cpu_theta, "_state", {"ok": True, "reason": ""})
    assert describe_impl("auto") == "auto (C++ Θ kernel for l2_norm_gelu on the CPU, fused " \
                                    "elsewhere)"
    assert [describe_impl(impl) for impl in ("fused", "torch", "triton")] == [
        "fused", "torch", "triton"]
    monkeypatch.setattr(cpu_theta, "_state", {"ok": False, "reason": "could not build: no c++"})
    assert describe_impl("auto") == ("auto (fused in training, reference in evaluation: the C++ "
                                     "kernel is unavailable, could not build: no c++)")


def test_unknown_impl_is_one_config_error():
    with pytest.raises(ConfigError, match="unknown Pattention impl 'fast'; choose one of auto, "
                                          "fused, reference, kernel, torch, triton"):
        Pattention(4, 4, 4, impl="fast")
    layer = Pattention(4, 4, 4)
    with pytest.raises(ConfigError, match="unknown Pattention impl"):
        layer.impl = "fast"
    assert layer.impl == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare_impl("torch")  # nothing to ready, nothing said
