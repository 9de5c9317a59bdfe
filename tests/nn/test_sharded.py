"""A Pattention split by parameter token over two gloo processes computes the unsharded layer,
with one all-reduce for Θ's row normaliser and one for the value product (nn/sharded.py)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tokenformer.errors import ConfigError
from tokenformer.nn.pattention import THETA_VARIANTS, Pattention
from tokenformer.nn.sharded import SHARDED_THETAS, ShardedPattention, all_reduce_sum

N_TOKENS, D_IN, D_OUT = 12, 8, 6
# (variant, explicit Θ factor or None for the default, ε)
CASES = [(norm, None, 0.0) for norm in THETA_VARIANTS] + [("l2_norm_gelu", 2.5, 1e-3)]


def full_layer(norm: str, scale: float | None, eps: float) -> Pattention:
    """The same unsharded float64 layer in every process (seeded)."""
    torch.manual_seed(0)
    layer = Pattention(D_IN, D_OUT, N_TOKENS, norm, scale=scale, eps=eps, impl="reference",
                       dtype=torch.float64)
    with torch.no_grad():  # keys large enough that Θ is far from linear
        layer.key_param_tokens.normal_(std=0.5)
        layer.value_param_tokens.normal_(std=0.5)
    return layer


def inputs() -> torch.Tensor:
    return torch.randn(3, 5, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def rank_outputs(rank: int, world: int, store: str) -> dict:
    """Every case's output on this rank, its number of rows and the shapes it all-reduced."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        reduce = all_reduce_sum()
        calls: list[tuple[int, ...]] = []

        def counted(t: torch.Tensor) -> torch.Tensor:
            calls.append(tuple(t.shape))
            return reduce(t)

        results = {}
        for case in CASES:
            calls.clear()
            sharded = ShardedPattention.from_pattention(full_layer(*case), rank, world, counted)
            with torch.no_grad():
                out = sharded(inputs())
            results[case] = (out, sharded.key_param_tokens.shape[0], list(calls))
        return results
    finally:
        dist.destroy_process_group()


def second_rank(store: str, out_file: str) -> None:
    torch.save(rank_outputs(1, 2, store), out_file)


def test_two_ranks_compute_the_unsharded_layer_with_two_all_reduces(tmp_path):
    """Rank 0 is this process, rank 1 a spawned one; both must return the unsharded output."""
    store, out_file = str(tmp_path / "store"), str(tmp_path / "rank1.pt")
    other = mp.get_context("spawn").Process(target=second_rank, args=(store, out_file))
    other.start()
    try:
        mine = rank_outputs(0, 2, store)
    finally:
        other.join(timeout=300)
    assert other.exitcode == 0
    theirs = torch.load(out_file)
    for case in CASES:
        with torch.no_grad():
            expected = full_layer(*case)(inputs())
        for out, rows, calls in (mine[case], theirs[case]):
            torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
            assert rows == N_TOKENS // 2  # each rank holds half the tokens
            norm_calls = [] if case[0] == "gelu" else [(3, 5, 1)]  # per-row sum, then [.., d_out]
            assert calls == [*norm_calls, (3, 5, D_OUT)]


def test_each_rank_holds_its_own_rows_of_keys_and_values():
    layer = full_layer("l2_norm_gelu", None, 0.0)
    halves = [ShardedPattention.from_pattention(layer, r, 2, lambda t: t) for r in (0, 1)]
    for name in ("key_param_tokens", "value_param_tokens"):
        joined = torch.cat([getattr(h, name) for h in halves])
        assert torch.equal(joined, getattr(layer, name))
    assert halves[1].scale == layer.scale  # √n of the whole layer, not of a half


def test_every_built_in_variant_has_a_sharded_form():
    assert set(SHARDED_THETAS) == set(THETA_VARIANTS)


@pytest.mark.parametrize("change, words", [
    (dict(top_k=4), "top-k Pattention cannot be split by token"),
    (dict(num_tokens=7), "7 parameter tokens do not split evenly over tensor_parallel_size 2"),
])
def test_what_does_not_split_is_refused_in_one_line(change, words):
    kwargs = dict(in_features=D_IN, out_features=D_OUT, num_tokens=N_TOKENS)
    kwargs.update(change)
    layer = Pattention(**kwargs)
    with pytest.raises(ConfigError, match=words):
        ShardedPattention.from_pattention(layer, 0, 2, lambda t: t)
