"""Growth recipes by name and the old tokens a growth keeps (issue 24): ``official-init`` (alias
``official``) and ``official-released``, ``noise_old`` and the rows ``freeze_old`` acts on.

Expectations come from the configs (which rows existed before), from the model before growth
and from the definition of the noise (a std relative to each tensor's rms)."""

from __future__ import annotations

import pytest
import torch

from tokenformer import GrowthError, TokenFormerConfig, TokenFormerLM
from tokenformer.ops.growth import FOREVER, grow, grow_with_optimizer, old_tokens

KINDS = {"attention.query": "qkv", "attention.key": "qkv", "attention.value": "qkv",
         "attention.proj": "proj", "mlp": "ffn"}


def model(seed: int = 0) -> TokenFormerLM:
    torch.manual_seed(seed)
    return TokenFormerLM(TokenFormerConfig(
        vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, qkv_tokens=48, proj_tokens=48,
        ffn_tokens=64, max_seq_len=16))


def trained() -> tuple[TokenFormerLM, torch.optim.AdamW]:
    """A model and its AdamW after two steps (non-zero moments to carry)."""
    m = model()
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        m(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return m, optimizer


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_old_tokens_are_the_rows_each_old_tensor_had() -> None:
    small = model()
    grown = grow(small, qkv="2x", ffn="2x", layers=3, positions=[1], freeze_old=10,
                 generator=gen())
    record = old_tokens(grown)
    assert record.freeze == 10
    expected = {}
    for new_layer in (0, 2):  # block 1 is inserted: none of its rows
        for module, kind in KINDS.items():
            n = getattr(small.config, f"{kind}_tokens")
            for leaf in ("key_param_tokens", "value_param_tokens"):
                expected[f"layers.{new_layer}.{module}.{leaf}"] = n
    assert record.rows == expected
    params = dict(grown.named_parameters())
    old = dict(small.named_parameters())
    for name, n in record.rows.items():  # exact: the old rows are the old tensor, unchanged
        source = name.replace("layers.2.", "layers.1.")
        assert torch.equal(params[name][:n], old[source])
    assert old_tokens(small) is None
    assert old_tokens(grow(small, ffn="2x", freeze_old="forever")).freeze == FOREVER
    assert old_tokens(grow(small, ffn="2x")).freeze is None


@pytest.mark.parametrize("copy", [True, False])
def test_noise_old_is_relative_to_each_tensors_rms_and_spares_the_new_rows(copy: bool) -> None:
    small = model()
    before = {n: p.detach().clone() for n, p in small.named_parameters()}
    plain = grow(small, ffn="2x", generator=gen(), copy=copy)
    noised = grow(small, ffn="2x", noise_old=0.1, generator=gen(), copy=copy)
    assert all(torch.equal(p, before[n]) for n, p in small.named_parameters())  # input untouched
    a = {n: p.detach() for n, p in plain.named_parameters()}
    b = {n: p.detach() for n, p in noised.named_parameters()}
    rows = old_tokens(noised).rows
    for name, p in a.items():
        if name not in rows:  # embedding, norms: not parameter tokens
            assert torch.equal(p, b[name])
            continue
        n = rows[name]
        assert torch.equal(p[n:], b[name][n:])  # new rows: drawn first, the same
        delta, old = (b[name][:n] - p[:n]).double(), p[:n].double()
        ratio = float(delta.std() / old.pow(2).mean().sqrt())
        assert ratio == pytest.approx(0.1, rel=0.12)  # >= 1536 draws per tensor
        assert abs(float(delta.mean())) < 4 * float(delta.std()) / delta.numel() ** 0.5


def test_bad_old_token_options_fail_before_any_work() -> None:
    small = model()
    for bad in ({"freeze_old": "soon"}, {"freeze_old": -3}, {"noise_old": -0.1},
                {"noise_old": float("nan")}, {"noise_old": True}):
        with pytest.raises(GrowthError, match=r"freeze_old|noise_old"):
            grow(small, ffn="2x", **bad)


def test_official_is_official_init_with_a_deprecation_note() -> None:
    small = model()
    with pytest.warns(DeprecationWarning, match="'official-init'"):
        old_name = grow(small, ffn="2x", layers=3, recipe="official", generator=gen())
    new_name = grow(small, ffn="2x", layers=3, recipe="official-init", generator=gen())
    released = grow(small, ffn="2x", layers=3, recipe="official-released", generator=gen())
    for a, b, c in zip(old_name.parameters(), new_name.parameters(), released.parameters(),
                       strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(GrowthError, match="official-init, official-released"):
        grow(small, ffn="2x", recipe="released")


def test_official_released_resets_the_optimizer_official_init_carries_it() -> None:
    small, optimizer = trained()
    _, carried = grow_with_optimizer(small, optimizer, ffn="2x", recipe="official-init",
                                     generator=gen())
    assert len(carried.state) == len(optimizer.state)
    assert all(float(s["step"]) == 2 for s in carried.state.values())
    _, fresh = grow_with_optimizer(small, optimizer, ffn="2x", recipe="official-released",
                                   generator=gen())
    assert len(fresh.state) == 0
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.1]
