"""The core behaviour on the device ``--device`` names (conftest.py): ``cpu`` by default (CI),
``cuda`` on a GPU (``pytest tests/test_device.py --device cuda``; skipped, with the reason, where
CUDA is absent). benchmarks/gpu.py runs this file on the GPU first.

Every CUDA branch of the library is exercised here at toy sizes: each Pattention impl and Θ
variant against a float64 reference computed on the CPU from the same weights (fp32, bf16
autocast, training and inference dispatch), cached vs uncached generation, function-preserving
growth, training with resume, the losses read back every few steps (the same records, fewer
waits for the device), the device's AdamW (fused on CUDA) taking a state saved on the CPU, the
fused-projection Transformer++ against float64, bf16 autocast against fp32, ``torch.compile``
of a training step, DDP and FSDP2 in one process (gloo on the CPU, NCCL on CUDA).

``torch.compile`` runs only with ``--device cuda``: compiling a training step takes tens of
seconds on a CPU, and CPU compilation is covered by test_kernels.py and benchmarks/compile.py.

The Triton Θ (``impl="triton"``) runs its compiled kernels on CUDA and, with ``--device cpu``,
Triton's interpreter on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was
imported (tests/nn/test_triton_theta.py runs these tests so, in a child process); otherwise its
tests are skipped, saying why.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenformer import THETA_VARIANTS, Pattention, TokenFormerConfig, TokenFormerLM, grow, theta
from tokenformer.io.process_group import World
from tokenformer.io.run_folders import step_dir
from tokenformer.models.baselines import TransformerConfig, TransformerLM, convert_projections
from tokenformer.nn.grouped import grouped_attend
from tokenformer.nn.kernels import triton_theta
from tokenformer.nn.pattention import PATTENTION_IMPLS
from tokenformer.training.config import TrainConfig
from tokenformer.training.distributed import load_sharded_model
from tokenformer.training.execution import Execution
from tokenformer.training.loop import RunState, fit
from tokenformer.training.optim import group_names, make_optimizer, rebuild_optimizer
from tokenformer.training.readback import READBACK_STEPS

# Normwise relative error of a result against its float64 reference. fp32: a few fp32 roundings
# (measured <= 3e-7 on the CPU; the bound leaves room for other accumulation orders, not for
# TF32); bf16 autocast: matmul inputs rounded to 8 bits of mantissa (2^-9 each) through two
# matmuls and Θ (measured <= 1e-2).
TOLERANCE = {"fp32": 2e-5, "bf16": 3e-2}


def needs_triton(device: torch.device) -> None:
    """Skip unless the Triton Θ runs on ``device`` (module docstring)."""
    if not triton_theta.available():
        pytest.skip(f"no Triton Θ: {triton_theta.unavailable_reason()}")
    if device.type == "cpu" and not triton_theta.interpreting():
        pytest.skip("the Triton Θ on the CPU needs TRITON_INTERPRET=1 set before triton is "
                    "imported (tests/nn/test_triton_theta.py runs these tests so)")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def tiny(**overrides) -> TokenFormerConfig:
    return TokenFormerConfig.from_name("tiny", **overrides)


def random_ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """Token ids drawn on the CPU (the same on every device)."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------- Pattention
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("impl", PATTENTION_IMPLS)
@pytest.mark.parametrize("norm", THETA_VARIANTS)
def test_pattention_matches_float64(device, norm, impl, precision):
    """Output and the gradients of X, K and V of a Pattention layer on the device, for every impl
    (``kernel`` falls back to ``fused`` where the C++ kernel does not apply, e.g. on CUDA),
    against Θ's formula evaluated in float64 on the CPU from the same weights; the no-grad output
    too (inference dispatches differently: the kernel or the reference, never the Function)."""
    g = torch.Generator().manual_seed(0)
    d_in, d_out, n = 48, 40, 96
    x = torch.randn(2, 33, d_in, generator=g, dtype=torch.float64)
    layer = Pattention(d_in, d_out, n, norm, impl=impl, device=device)
    with torch.no_grad():  # keys ~ 1/√d, values ~ 1/√n: outputs of order one
        layer.key_param_tokens.copy_(torch.randn(n, d_in, generator=g) / math.sqrt(d_in))
        layer.value_param_tokens.copy_(torch.randn(n, d_out, generator=g) / math.sqrt(n))
    grad_y = torch.randn(2, 33, d_out, generator=g, dtype=torch.float64)

    leaves = [x.clone().requires_grad_(), layer.key_param_tokens.detach().cpu().double(),
              layer.value_param_tokens.detach().cpu().double()]
    for leaf in leaves[1:]:
        leaf.requires_grad_()
    y64 = theta(leaves[0] @ leaves[1].t(), norm, layer.scale) @ leaves[2]
    truth = (y64, *torch.autograd.grad(y64, leaves, grad_y))

    xd = x.float().to(device).requires_grad_()
    with autocast(device, precision):
        y = layer(xd)
    y.backward(grad_y.to(device, y.dtype))
    got = (y, xd.grad, layer.key_param_tokens.grad, layer.value_param_tokens.grad)
    with torch.no_grad(), autocast(device, precision):
        inference = layer(x.float().to(device))
    for name, a, b in zip(("y", "dX", "dK", "dV", "y (no grad)"), (*got, inference),
                          (*truth, y64), strict=True):
        assert a.device.type == device.type and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert norm_rel(a, b) < TOLERANCE[precision], (name, norm_rel(a, b))


@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize(("dtype", "groups"), [(torch.float32, 1), (torch.bfloat16, 1),
                                               (torch.float32, 3)],
                         ids=["fp32", "bf16", "fp32-segments"])
@pytest.mark.parametrize("norm", THETA_VARIANTS)
def test_triton_theta_matches_float64(device, norm, dtype, groups, block):
    """The Triton Θ op forward and backward against Θ's formula in float64, on rows of n = 300
    scores (not a power of two; ``block=64``: five blocks per row, the two-sweep kernels; None:
    the whole row in one block), with an all-zero row and eps > 0 (where the norm's subgradient
    0 applies). fp32 to a few roundings; bf16 (stored in 8 bits of mantissa) no worse than twice
    the PyTorch formula's own error in bf16. ``segments``: rows of 3 × 300 scores, Θ of each
    segment of 300 returned segment-major ([3, rows, 300], the one-GEMM Q/K/V's layout), dΘ
    taken in that layout and dS returned in the scores'."""
    needs_triton(device)
    g = torch.Generator().manual_seed(1)
    s64 = torch.randn(9, groups * 300, generator=g, dtype=torch.float64) * 2
    s64[4] = 0.0
    grad = torch.randn(groups, 9, 300, generator=g, dtype=torch.float64).squeeze(0)
    scale, eps = 7.0, 1e-3

    def formula(s: torch.Tensor) -> torch.Tensor:
        out = theta(s.view(9, groups, 300), norm, scale, eps).transpose(0, 1)
        return out.squeeze(0)

    def kernels(s: torch.Tensor) -> torch.Tensor:
        if groups == 1:
            return triton_theta.theta(s, norm, scale, eps, block=block)
        return triton_theta.theta_segments(s, groups, norm, scale, eps, block=block)

    def run(fn, s: torch.Tensor):
        s = s.clone().requires_grad_()
        out = fn(s)
        (ds,) = torch.autograd.grad(out, s, grad.to(s.device, out.dtype))
        return out, ds

    truth = run(formula, s64)
    got = run(kernels, s64.to(device, dtype))
    own = run(formula, s64.to(dtype))  # the formula in dtype
    for name, a, b, c in zip(("theta", "dS"), got, truth, own, strict=True):
        assert a.dtype == dtype and a.device.type == device.type, name
        assert torch.isfinite(a).all(), name
        bound = 1e-6 if dtype == torch.float32 else 2 * norm_rel(c, b)
        assert norm_rel(a, b) <= bound, (name, norm_rel(a, b), bound)
    assert got[0].is_contiguous() and got[1].shape == s64.shape
    if norm != "softmax":  # a zero row: Θ = 0 (the GELU of zero scores, or a zero numerator)
        assert (got[0][..., 4, :] == 0).all()


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's 0·inf
@pytest.mark.parametrize("norm", ["l2_norm_gelu", "gelu_l2_norm", "gelu_l1_norm"])
def test_triton_theta_zero_row_without_eps_is_nan_like_the_reference(device, norm):
    """eps = 0 keeps the official arithmetic: an all-zero row's norm is 0 and Θ is NaN there
    (as in the released code and ``theta``), the other rows are unaffected."""
    needs_triton(device)
    s = torch.randn(3, 200, dtype=torch.float64)
    s[1] = 0.0
    reference = theta(s, norm, 5.0)
    out = triton_theta.theta(s.float().to(device), norm, 5.0, 0.0).cpu()
    assert torch.isnan(reference[1]).all() and torch.isnan(out[1]).all()
    assert norm_rel(out[[0, 2]], reference[[0, 2]]) < 1e-6


@pytest.mark.parametrize("groups", [1, 3], ids=["rows", "segments"])
def test_triton_ops_pass_opcheck(device, groups):
    """The forward and backward ops' registration (schema, fake tensors, autograd, AOT dispatch)
    passes torch.library.opcheck, with strided rows and more than one block, row-wise and in
    segments."""
    needs_triton(device)
    triton_theta.prepare()
    fwd, bwd = triton_theta._ops()
    rows, n = (6, 150) if groups == 1 else (3, 100)  # n per segment; the interpreter is slow
    s = torch.randn(rows, 2 * groups * n, device=device)[:, :groups * n]  # rows strided
    fwd_args = (s.requires_grad_(), "gelu_l2_norm", 4.0, 1e-6, 64, groups)
    torch.library.opcheck(fwd, fwd_args)
    r = fwd(*fwd_args)[1].detach()
    torch.library.opcheck(bwd, (torch.randn(groups * rows, n, device=device), s.detach(), r,
                                "gelu_l2_norm", 4.0, 1e-6, 64, groups))


@pytest.mark.parametrize("norm", ["l2_norm_gelu", "softmax"])
def test_triton_pattention_compiles_without_graph_breaks(device, norm):
    """``torch.compile(fullgraph=True)`` (inductor) of a Pattention with ``impl="triton"``:
    forward and gradients equal the eager ones (a graph break would raise). On CUDA the op is a
    triton_op inductor traces; under the interpreter an opaque custom op of its own."""
    needs_triton(device)
    torch.manual_seed(0)
    layer = Pattention(32, 24, 200, norm, impl="triton", device=device)
    x = torch.randn(2, 17, 32, device=device)

    def step(layer: Pattention, x: torch.Tensor) -> torch.Tensor:
        layer.zero_grad()
        y = layer(x)
        y.square().sum().backward()
        return y.detach(), layer.key_param_tokens.grad.clone()

    eager = step(layer, x)
    torch._dynamo.reset()
    compiled = step(torch.compile(layer, fullgraph=True), x)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", [(96, 96, 96), (96, 120, 144)], ids=["equal-n", "grown-n"])
@pytest.mark.parametrize("impl", ["fused", "triton"])
def test_grouped_qkv_matches_float64(device, impl, sizes):
    """One GEMM for three Pattentions (nn.grouped; Θ per segment, grouped value product): the
    outputs and gradients of X and of every K and V against the float64 formula, as close as
    the separate layers' are, in fp32 and bf16 autocast."""
    if impl == "triton":
        needs_triton(device)
    g = torch.Generator().manual_seed(0)
    d = 48
    ps = [Pattention(d, d, n, "l2_norm_gelu", impl=impl, device=device) for n in sizes]
    for p in ps:
        with torch.no_grad():
            p.key_param_tokens.copy_(torch.randn(p.num_tokens, d, generator=g) / math.sqrt(d))
            p.value_param_tokens.copy_(torch.randn(p.num_tokens, d, generator=g)
                                       / math.sqrt(p.num_tokens))
    # 33 rows on a GPU; 9 on the CPU, where the Triton interpreter runs each program in Python
    rows = 33 if device.type == "cuda" else 9
    x = torch.randn(2, rows, d, generator=g, dtype=torch.float64)
    params = [t for p in ps for t in (p.key_param_tokens, p.value_param_tokens)]

    def grads(fn, x, params):
        ys = fn(x)
        loss = sum((y.double() * torch.cos(torch.arange(y.numel(), device=y.device)
                                           ).view_as(y)).sum() for y in ys)
        return [y.detach() for y in ys], torch.autograd.grad(loss, [x, *params])

    leaves = [t.detach().cpu().double().requires_grad_() for t in params]
    truth = grads(lambda x: [theta(x @ leaves[2 * i].t(), "l2_norm_gelu", p.scale)
                             @ leaves[2 * i + 1] for i, p in enumerate(ps)],
                  x.clone().requires_grad_(), leaves)
    for precision in ("fp32", "bf16"):
        results = {}
        for name, fn in (("grouped", lambda x: grouped_attend(x, ps)),
                         ("separate", lambda x: [p(x) for p in ps])):
            xd = x.float().to(device).requires_grad_()
            with autocast(device, precision):
                results[name] = grads(fn, xd, params)
        for got, sep, want in zip([*results["grouped"][0], *results["grouped"][1]],
                                  [*results["separate"][0], *results["separate"][1]],
                                  [*truth[0], *truth[1]], strict=True):
            assert torch.isfinite(got).all()
            assert norm_rel(got, want) <= max(2 * norm_rel(sep, want), TOLERANCE["fp32"]), (
                precision, norm_rel(got, want), norm_rel(sep, want))


@pytest.mark.parametrize("impl", ["fused", "triton"])
def test_grouped_qkv_compiles_without_graph_breaks(device, impl):
    """``torch.compile(fullgraph=True)`` of the one-GEMM Q/K/V's forward and backward (its
    value product's backward takes another form when traced): loss and every gradient equal
    eager's. Inductor on CUDA; on the CPU the ``aot_eager`` backend (dynamo and AOTAutograd
    tracing, what a graph break or an untraceable op would fail; inductor's CPU code is
    test_kernels.py's)."""
    if impl == "triton":
        needs_triton(device)
    torch.manual_seed(0)
    ps = [Pattention(32, 24, 48, "l2_norm_gelu", impl=impl, device=device) for _ in range(3)]
    x = torch.randn(2, 9, 32, device=device)
    weight = torch.randn(2, 9, 24, device=device)

    def step(x: torch.Tensor) -> torch.Tensor:
        return sum((y * weight).sum() for y in grouped_attend(x, ps))

    def run(fn) -> list[torch.Tensor]:
        for p in ps:
            p.zero_grad()
        xd = x.clone().requires_grad_()
        loss = fn(xd)
        loss.backward()
        return [loss.detach(), xd.grad, *(t.grad for p in ps for t in p.parameters())]

    eager = run(step)
    torch._dynamo.reset()
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    for a, b in zip(run(torch.compile(step, backend=backend, fullgraph=True)), eager,
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# aten ops that only move data (a layout change, a concatenation, a same-dtype cast): on an
# activation-sized tensor each is a pass over memory that computes nothing.
DATA_MOVES = frozenset({"clone", "copy_", "_to_copy", "contiguous", "cat", "stack",
                        "_reshape_copy", "as_strided_scatter", "slice_scatter", "select_scatter"})


class ActivationCopies(TorchDispatchMode):
    """The :data:`DATA_MOVES` ops run under it whose output is activation-sized: its number of
    elements a multiple of ``rows``, a prime that divides no weight's size (weights may be
    concatenated: that is a copy of parameters, not of activations)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (list, tuple)) else [out]
        if func.overloadpacket.__name__ in DATA_MOVES and any(
                isinstance(t, torch.Tensor) and t.numel() % self.rows == 0 for t in results):
            self.seen.append(f"{func} -> {[tuple(t.shape) for t in results]}")
        return out


@pytest.mark.parametrize("impl", ["fused", "triton"])
def test_grouped_qkv_copies_no_activation(device, impl):
    """Forward and backward of the one-GEMM Q/K/V (equal n) copy no activation-sized tensor
    (:class:`ActivationCopies`): no clone of the [rows, 3n] score gradient to undo a transpose,
    no stack of the three outputs' gradients. The counter's control: the same value product as
    autograd sees a ``view → transpose → bmm → unbind`` (the earlier design) counts both."""
    if impl == "triton":
        needs_triton(device)
    rows, d, n = 29, 24, 40
    g = torch.Generator().manual_seed(0)
    ps = [Pattention(d, d, n, "l2_norm_gelu", impl=impl, device=device) for _ in range(3)]
    x = torch.randn(rows, d, generator=g).to(device).requires_grad_()
    weight = torch.randn(rows, d, generator=g).to(device)  # dense output gradients
    with ActivationCopies(rows) as copies:
        ys = grouped_attend(x, ps)
        sum((y * weight).sum() for y in ys).backward()
    assert copies.seen == []
    assert all(p.key_param_tokens.grad is not None for p in ps) and x.grad is not None

    values = torch.randn(3, n, d, device=device)
    scores = torch.randn(rows, 3 * n, device=device, requires_grad=True)
    with ActivationCopies(rows) as control:
        theta_ = torch.nn.functional.gelu(scores).view(rows, 3, n).transpose(0, 1)
        ys = torch.bmm(theta_, values).unbind(0)
        sum((y * weight).sum() for y in ys).backward()
    assert [op.split(" ")[0] for op in control.seen] == ["aten.stack.default",
                                                         "aten.clone.default"]


# -------------------------------------------------------------------------------------- the LM
def test_cached_generation_matches_uncached(device):
    """Greedy generation with the KV cache gives the tokens of generation without it, for equal
    prompts and for left-padded prompts of different lengths; each generated token is the argmax
    of one full forward over the finished sequence (teacher forcing)."""
    torch.manual_seed(0)
    model = TokenFormerLM(tiny()).to(device).eval()
    vocab = model.config.vocab_size
    prompt = random_ids(vocab, 2, 5).to(device)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device=device)
    lengths: list[int] = []  # tokens per forward call: the cached path feeds one at a time
    model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    with torch.no_grad():
        for attention_mask in (None, mask):
            lengths.clear()
            cached = model.generate(prompt, 16, attention_mask=attention_mask)
            assert lengths == [5] + [1] * 15
            uncached = model.generate(prompt, 16, attention_mask=attention_mask, use_cache=False)
            assert cached.shape == (2, 21)
            assert torch.equal(cached, uncached), attention_mask
        logits = model(cached[1:]).logits[:, 4:-1, :vocab]  # the unpadded row
        assert torch.equal(logits.argmax(-1), cached[1:, 5:])


@pytest.mark.parametrize("compiled", [False, True])
def test_static_cache_generation_matches_dynamic(device, compiled):
    """generate(cache_implementation="static") gives the dynamic cache's greedy tokens on the
    device, for batch 1 and a left-padded batch, on a model grown by tokens (Q/K/V, proj and FFN
    Pattentions of three different sizes) read with top-k Pattention (float64: no near-ties).
    ``compiled``: the step under torch.compile (fullgraph; mode="reduce-overhead", a CUDA graph
    replayed at every token, and no cudagraph skip). CUDA only, like every compile here (module
    docstring); the CPU's inductor path is tests/models/test_lm.py's."""
    if compiled and device.type != "cuda":
        pytest.skip("the compiled, CUDA-graph decoding step runs with --device cuda only (the "
                    "CPU's inductor: test_lm.py::test_compiled_static_generate_equals_eager)")
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = grow(TokenFormerLM(tiny()), qkv="2x", ffn="3x", recipe="paper",
                 generator=torch.Generator().manual_seed(1))
    assert len({layer.num_tokens for layer in model.pattentions().values()}) == 3
    for layer in model.layers:
        layer.mlp.top_k = 0.25
    model = model.to(device, torch.float64).eval()
    prompt = random_ids(model.config.vocab_size, 3, 7).to(device)
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], device=device)
    for ids, attention_mask in ((prompt[:1], None), (prompt, mask)):
        dynamic = model.generate(ids, 16, attention_mask=attention_mask)
        static = model.generate(ids, 16, attention_mask=attention_mask,
                                cache_implementation="static", compile=compiled)
        assert static.device.type == device.type and torch.equal(static, dynamic)
    assert not torch._dynamo.utils.counters["inductor"].get("cudagraph_skips")


def test_compiled_decoding_step_buckets_sampling_and_no_sync(device):
    """The decoding step compiled on the device (on CUDA mode="reduce-overhead": a CUDA graph
    replayed at every token), issue 43: 12 prompt lengths in two batch sizes give the eager
    static path's tokens and compile one graph per batch size and capacity bucket (4), not one
    per shape; seeded sampling with top-k and top-p (chosen inside the graph) and eos stopping
    give the eager tokens; no cudagraph skip; and a captured step runs with no host sync
    (``torch.cuda.set_sync_debug_mode("error")``). CUDA only, like every compile here (module
    docstring); the CPU's inductor path is test_lm.py::test_compiled_step_serves_twenty_shapes."""
    if device.type != "cuda":
        pytest.skip("the compiled, CUDA-graph decoding step runs with --device cuda only (the "
                    "CPU's inductor: test_lm.py::test_compiled_step_serves_twenty_shapes)")
    import torch._dynamo

    from tokenformer.models import generation

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TokenFormerLM(tiny()).to(device).eval()  # context 128: buckets 64 and 128
    vocab = model.config.vocab_size
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    shapes = [(1, n) for n in (3, 9, 30, 61, 70, 100)] + [(4, n) for n in (2, 17, 60, 65, 90, 120)]
    for batch, length in shapes:
        prompt = random_ids(vocab, batch, length, seed=length).to(device)
        eager = model.generate(prompt, 4, cache_implementation="static")
        compiled = model.generate(prompt, 4, cache_implementation="static", compile=True)
        assert torch.equal(compiled, eager), (batch, length)
    assert graphs["unique_graphs"] - before == 4
    prompt = random_ids(vocab, 2, 7).to(device)
    free = model.generate(prompt, 20, cache_implementation="static")
    for kwargs in ({"do_sample": True, "temperature": 1.3, "top_k": 50, "top_p": 0.9},
                   {"eos_token_id": int(free[0, 9])}):
        runs = [model.generate(prompt, 20, cache_implementation="static", compile=compiled,
                               generator=torch.Generator(device=device).manual_seed(0),
                               **kwargs)
                for compiled in (False, True)]
        assert torch.equal(runs[1], runs[0]), kwargs
    assert not torch._dynamo.utils.counters["inductor"].get("cudagraph_skips")
    state = generation._decode_state(model, 2, 64)  # the last runs' state, its graph captured
    step = generation._compiled_decode_step(device)
    with torch.no_grad():
        for _ in range(3):
            step(model, state, None)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                step(model, state, None)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("norm", THETA_VARIANTS)
def test_growth_preserves_function(device, norm):
    """Exact growth on the device (2x tokens of every kind, one more block) leaves the logits
    unchanged to fp32 rounding, for every Θ variant; the new tokens and block are really there."""
    torch.manual_seed(0)
    model = TokenFormerLM(tiny(norm=norm)).to(device).eval()
    ids = random_ids(model.config.vocab_size, 2, 24).to(device)
    grown = grow(model, qkv="2x", proj="2x", ffn="2x", layers=3, recipe="exact",
                 generator=torch.Generator().manual_seed(1)).eval()
    assert next(grown.parameters()).device.type == device.type
    assert (grown.config.ffn_tokens, grown.config.num_layers) == (256, 3)
    with torch.no_grad():
        before, after = model(ids).logits, grown(ids).logits
    assert norm_rel(after, before) < 1e-5


def lm_batches(vocab: int, batch_size: int, seq_len: int, device: torch.device):
    """``fit``'s batch function: random token ids, a pure function of the step."""
    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        ids = random_ids(vocab, batch_size, seq_len, seed=step).to(device)
        return {"input_ids": ids, "labels": ids}
    return batch_fn


def train_config(**overrides) -> TrainConfig:
    return TrainConfig(**{"steps": 4, "batch_size": 4, "seq_len": 32, "warmup_steps": 1,
                          "eval_interval": 0, "samples": 0, "lr": 3e-3, **overrides})


@contextlib.contextmanager
def deterministic(device: torch.device):
    """Deterministic CUDA kernels (SDPA's backward, index_add) for a bit-for-bit comparison;
    conftest sets CUBLAS_WORKSPACE_CONFIG for --device cuda. A no-op on the CPU."""
    if device.type != "cuda":
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_resumes_bit_for_bit(device, precision, tmp_path):
    """Four steps of ``fit`` with a checkpoint at step 2; resuming from it gives steps 3 and 4
    with the same losses as the uninterrupted run, to the bit, and the loss falls."""
    cfg = train_config(precision=precision, checkpoint_interval=2)
    batch_fn = lm_batches(257, 4, 32, device)
    with deterministic(device):
        torch.manual_seed(0)
        whole = fit(TokenFormerLM(tiny()), batch_fn, cfg, out_dir=tmp_path / "run",
                    execution=Execution(device=device), progress=False)
        resumed = fit(TokenFormerLM(tiny()), batch_fn, cfg,
                      start=RunState(resume_from=step_dir(tmp_path / "run", 2)),
                      execution=Execution(device=device), progress=False)
    assert all(math.isfinite(v) for v in whole.losses) and whole.losses[-1] < whole.losses[0]
    difference = max(abs(a - b) for a, b in zip(resumed.losses, whole.losses[2:], strict=True))
    assert resumed.losses == whole.losses[2:], (
        f"max |Δloss| {difference:.3g} (tiny: a CUDA kernel that is not deterministic, not the "
        f"resume)")


TIMING = ("train_time", "elapsed", "tokens_per_s", "flops_per_s")  # measured, not computed


def test_losses_read_back_every_few_steps_record_what_every_step_does(device):
    """``fit`` with the device's read-back interval (every READBACK_STEPS steps on CUDA, every
    step on the CPU) and every 3 steps gives the records of reading every step, bit for bit
    (the loss, gradient norm, LR, tokens and FLOPs of each step, the evaluations among them);
    only the measured times differ."""
    batch_fn = lm_batches(257, 4, 32, device)
    held_out = batch_fn(99)

    def eval_fn(model):
        with torch.no_grad():
            return {"val_loss": model(**held_out).loss.item()}

    records = {}
    with deterministic(device):
        for readback in (1, 3, None):
            torch.manual_seed(0)
            cfg = train_config(steps=7, eval_interval=5, grad_clip=1.0)
            result = fit(TokenFormerLM(tiny()), batch_fn, cfg, eval_fn=eval_fn,
                         execution=Execution(device=device, readback=readback), progress=False)
            records[readback] = [{k: v for k, v in r.items() if k not in TIMING}
                                 for r in result.records]
    assert [r["type"] for r in records[1]].count("eval") == 2
    assert records[3] == records[1] and records[None] == records[1]


def test_a_step_does_not_wait_for_the_device(device):
    """Reading the losses back every 8 steps instead of every step leaves at least 7 fewer
    synchronizing CUDA calls in 8 steps (torch's sync debug mode counts them): the host queues
    the next steps while the device runs. CUDA only: a CPU step is done when it returns."""
    if device.type != "cuda":
        pytest.skip("the host waits for the device only on CUDA (the CPU computes in the call)")
    batch_fn = lm_batches(257, 4, 32, device)
    model = TokenFormerLM(tiny()).to(device)
    result = fit(model, batch_fn, train_config(steps=2), execution=Execution(device=device),
                 progress=False)

    def synchronizing_calls(readback: int) -> int:
        start = result.step + 8 * readback  # a fresh span of 8 steps each time
        cfg = train_config(steps=start + 8)
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fit(result.model, batch_fn, cfg,
                    start=RunState(step=start, optimizer=result.optimizer),
                    execution=Execution(device=device, readback=readback), progress=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    every, late = synchronizing_calls(1), synchronizing_calls(8)
    assert late <= every - 7, (every, late)
    assert READBACK_STEPS >= 8


def test_optimizer_is_the_devices_and_takes_a_state_saved_on_the_cpu(device):
    """AdamW runs torch's fused kernel on CUDA and torch's default (the per-tensor loop) on
    the CPU, for TokenFormer and the baselines alike; a state saved by the CPU's AdamW, rebuilt
    on the device, takes the device's implementation (its step counters where that wants them)
    and steps on as the CPU's does, to fp32 rounding (the same gradients given to both)."""
    cfg = train_config()
    want = (False, True) if device.type == "cuda" else (False, False)
    for model in (TokenFormerLM(tiny()), TransformerLM(TransformerConfig(arch="transformer++"))):
        groups = make_optimizer(model.to(device), cfg).param_groups
        assert {(bool(g["foreach"]), bool(g["fused"])) for g in groups} == {want}
    torch.manual_seed(0)
    cpu_model = TokenFormerLM(tiny())
    cpu_opt = make_optimizer(cpu_model, cfg)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) for p in cpu_model.parameters()]
             for _ in range(2)]

    def step(model, optimizer, grads) -> None:
        for p, grad in zip(model.parameters(), grads, strict=True):
            p.grad = grad.to(p.device)
        optimizer.step()

    step(cpu_model, cpu_opt, grads[0])
    dev_model = TokenFormerLM(tiny())
    dev_model.load_state_dict(cpu_model.state_dict())
    dev_model.to(device)
    saved = copy.deepcopy(cpu_opt.state_dict())  # as read from a file: no tensor shared
    dev_opt = rebuild_optimizer(dev_model, group_names(cpu_model, cpu_opt), saved,
                                "optimizer.safetensors", cfg)
    assert {(bool(g["foreach"]), bool(g["fused"])) for g in dev_opt.param_groups} == {want}
    for p in dev_model.parameters():
        counter = dev_opt.state[p]["step"]
        assert float(counter) == 1.0
        assert counter.device.type == (device.type if want[1] else "cpu")
    step(cpu_model, cpu_opt, grads[1])
    step(dev_model, dev_opt, grads[1])
    for (name, a), b in zip(dev_model.named_parameters(), cpu_model.parameters(), strict=True):
        assert norm_rel(a, b) < TOLERANCE["fp32"], name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_baseline_matches_float64(device, precision):
    """Transformer++ with fused Q/K/V and gate/up (one GEMM each) holding an unfused model's
    weights: its logits and gradients against the unfused model's in float64 on the CPU, as
    close as the unfused model's own on the device, in fp32 and bf16 autocast."""
    torch.manual_seed(0)
    config = TransformerConfig(arch="transformer++", vocab_size=257, hidden_size=64,
                               num_layers=2, num_heads=4, intermediate_size=96, max_seq_len=32)
    plain = TransformerLM(config)
    fused = TransformerLM(TransformerConfig(**{**config.to_dict(), "fused_projections": True}))
    fused.load_state_dict(convert_projections(plain.state_dict(), fused=True))
    ids = random_ids(257, 2, 32)

    def run(model, device, precision):
        model = model.to(device)
        model.zero_grad(set_to_none=True)
        with autocast(device, precision):
            out = model(ids.to(device), labels=ids.to(device))
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return out.logits, convert_projections(grads, fused=False)

    truth = run(copy.deepcopy(plain).double(), torch.device("cpu"), "fp32")
    own = run(plain, device, precision)
    got = run(fused, device, precision)
    assert norm_rel(got[0], truth[0]) <= max(2 * norm_rel(own[0], truth[0]),
                                             TOLERANCE["fp32"])
    for name, want in truth[1].items():
        bound = max(2 * norm_rel(own[1][name], want), TOLERANCE["fp32"])
        assert norm_rel(got[1][name], want) <= bound, (name, precision)


@pytest.mark.parametrize("norm", THETA_VARIANTS)
def test_bf16_autocast_is_finite_and_close_to_fp32(device, norm):
    """One forward + backward of the LM under bf16 autocast: finite, the loss within 1 % and
    the gradients within bf16 tolerance (normwise, measured 0.5–2 % on the CPU) of fp32's."""
    torch.manual_seed(0)
    model = TokenFormerLM(tiny(norm=norm)).to(device)
    ids = random_ids(model.config.vocab_size, 4, 64).to(device)

    def loss_and_grads(precision: str) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with autocast(device, precision):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss32, grads32 = loss_and_grads("fp32")
    loss16, grads16 = loss_and_grads("bf16")
    assert math.isfinite(loss16) and abs(loss16 - loss32) < 1e-2 * loss32
    whole = torch.cat([g.flatten() for g in grads32.values()])
    assert norm_rel(torch.cat([g.flatten() for g in grads16.values()]), whole) < 5e-2
    for name, grad in grads16.items():
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all(), name
        # a parameter whose gradient is ~0 at initialisation (softmax Θ's Q and K: near-uniform
        # weights) is compared on the scale of the whole gradient, not its own
        error = torch.linalg.vector_norm(grad - grads32[name])
        bound = 5e-2 * torch.linalg.vector_norm(grads32[name]) + 1e-3 * whole.norm()
        assert error <= bound, (name, error.item(), bound.item())


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_training_step_matches_eager(device, precision, mode):
    """``fit`` with ``compile=True`` (the model under torch.compile: inductor, and with
    ``mode="reduce-overhead"`` its CUDA graphs, what ``tokenformer scale --compile`` trains the
    frontier's runs with) gives the eager losses over five steps with a growth after step 2
    (a recompile) and evaluations between steps, as a frontier run has. CUDA only: on a CPU this
    takes tens of seconds (module docstring)."""
    if device.type != "cuda":
        pytest.skip("torch.compile of a training step runs with --device cuda only (slow on a "
                    "CPU; CPU compilation: test_kernels.py, benchmarks/compile.py)")
    batch_fn = lm_batches(257, 4, 32, device)
    held_out = batch_fn(99)

    def eval_fn(model):
        with torch.no_grad(), autocast(device, precision):
            return {"val_loss": model(**held_out).loss.item()}

    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        cfg = train_config(steps=5, precision=precision, compile=compiled, compile_mode=mode,
                           grow_at=["2:ffn=192,recipe=paper"], eval_interval=2)
        runs[compiled] = fit(TokenFormerLM(tiny()), batch_fn, cfg, eval_fn=eval_fn,
                             execution=Execution(device=device), progress=False)
    rel = 1e-3 if precision == "bf16" else 1e-5
    assert runs[True].model.config.ffn_tokens == 192
    assert runs[True].losses == pytest.approx(runs[False].losses, rel=rel)
    evals = {c: [r["val_loss"] for r in run.records if r["type"] == "eval"]
             for c, run in runs.items()}
    assert len(evals[True]) >= 2
    assert evals[True] == pytest.approx(evals[False], rel=rel)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_data_parallel_in_one_process(device, strategy, tmp_path):
    """DDP and FSDP2 over a process group of one (gloo on the CPU, NCCL on CUDA) train like the
    plain model; the FSDP run's final checkpoint is sharded (DCP) and reads back in one process
    to the trained weights."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # as under torchrun: the rank's own GPU, by index (DDP's device_ids)
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    cfg = train_config(strategy=strategy)
    batch_fn = lm_batches(257, 4, 32, device)
    torch.manual_seed(0)
    plain = fit(TokenFormerLM(tiny()), batch_fn, train_config(), execution=Execution(device=device),
                progress=False)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        wrapped = fit(TokenFormerLM(tiny()), batch_fn, cfg, out_dir=tmp_path / "run",
                      execution=Execution(world=World(strategy=strategy), device=device),
                      progress=False)
        # FSDP's parameters are DTensors: gathered while the process group exists
        trained = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                   for n, p in wrapped.model.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert wrapped.losses == pytest.approx(plain.losses, rel=1e-5)
    if strategy == "fsdp":
        final = tmp_path / "run" / "final"
        assert (final / "sharded").is_dir()
        for name, p in load_sharded_model(final).named_parameters():
            assert torch.equal(p, trained[name]), name
