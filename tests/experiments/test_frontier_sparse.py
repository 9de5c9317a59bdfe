"""The frontier's product-key arm (issue 18, ``tokenformer scale --preset sparse``): the plan
(FLOPs per token matched to dense, n ≈ 16× dense, one schedule family, LR = the sweep's argmin),
the product-key FLOP count against torch's counter, and a tiny run of the preset on CPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tokenformer.errors import ConfigError
from tokenformer.experiments.frontier import configs as configs_
from tokenformer.experiments.frontier import plan as plan_
from tokenformer.experiments.frontier import presets as presets_
from tokenformer.experiments.frontier import report
from tokenformer.experiments.frontier import run as run_
from tokenformer.experiments.frontier.configs import product_key_config
from tokenformer.experiments.frontier.plan import plan
from tokenformer.experiments.frontier.presets import get_preset
from tokenformer.models.baselines import model_class
from tokenformer.models.config import THETA_FLOPS_PER_SCORE, TokenFormerConfig, flops_per_token

KJV_TRAIN_TOKENS = 4_000_000


# ---------------------------------------------------------------------------------- the plan
def test_sparse_preset_plan_matches_flops_and_multiplies_tokens():
    preset = get_preset("sparse")
    assert set(preset.families) == {"tokenformer", "transformer++", "tokenformer-pk16"}
    assert not preset.chains and not preset.widenings
    budgets = preset.budgets
    assert len(budgets) >= 2 and math.log10(budgets[-1] / budgets[0]) >= 1 - 1e-9
    runs = plan(preset, 256, KJV_TRAIN_TOKENS)
    sweeps = plan_.sweep_plan(preset, 256)
    assert len(preset.lr_grid) >= 4
    assert {r.kind for r in runs} == {"scratch"}  # no growth chain, no widening
    for run in runs + sweeps:
        assert run.schedule == "wsd" and len(run.stages) == 1
    for arm in {r.arm for r in runs}:
        assert len({r.seed for r in runs if r.arm == arm}) >= 3
    dense = list(configs_.model_configs(preset, "tokenformer", 256).values())
    pk = list(configs_.model_configs(preset, "tokenformer-pk16", 256).values())
    assert len(pk) == len(dense) == preset.num_sizes >= 2
    for d, p in zip(dense, pk, strict=True):
        assert p.ffn_keys == "product" and d.ffn_keys == "dense"
        s = math.isqrt(p.ffn_tokens)
        assert s * s == p.ffn_tokens
        # n ≈ 16× dense: s is the integer nearest √(16·n_dense), so within (s ± 1/2)²
        assert abs(p.ffn_tokens / d.ffn_tokens - 16) <= 16 * (2 / s + 1 / s ** 2)
        assert abs(p.ffn_tokens / d.ffn_tokens - 16) < 0.5
        # the FFN's forward FLOPs by hand (d = 64, l2_norm_gelu: 8 FLOPs per Θ score)
        h, k, theta = d.hidden_size, p.ffn_product_k, THETA_FLOPS_PER_SCORE[d.norm]
        dense_ffn = 2 * d.ffn_tokens * 2 * h + theta * d.ffn_tokens
        pk_ffn = 2 * s * h + min(k, s) ** 2 + theta * k + 2 * k * h
        assert abs(pk_ffn / dense_ffn - 1) <= presets_.PK_FLOPS_TOLERANCE
        # k is the best integer: one more or one fewer token is farther from dense
        for other in (k - 1, k + 1):
            alt = 2 * s * h + min(other, s) ** 2 + theta * other + 2 * other * h
            assert abs(alt - dense_ffn) >= abs(pk_ffn - dense_ffn)
        # everything but the FFN is the dense model's, so the whole model's FLOPs match
        fd = flops_per_token(d, preset.seq_len, training=True)
        fp = flops_per_token(p, preset.seq_len, training=True)
        assert fp["total"] == pytest.approx(fd["total"], rel=presets_.PK_FLOPS_TOLERANCE)
        L = d.num_layers  # "ffn" is per layer
        assert fp["total"] - L * fp["ffn"] == fd["total"] - L * fd["ffn"]
        # and many more parameters at those FLOPs (the question the arm asks)
        assert p.num_parameters(non_embedding=True) > 4 * d.num_parameters(non_embedding=True)
    # the 64× family builds at the same FLOPs too (not in the preset: CPU time)
    for d, p in zip(dense, configs_.model_configs(preset, "tokenformer-pk64", 256).values(),
                    strict=True):
        assert abs(p.ffn_tokens / d.ffn_tokens - 64) < 1
        assert p.projection_flops()[1] == pytest.approx(d.projection_flops()[1],
                                                        rel=presets_.PK_FLOPS_TOLERANCE)
    # every pk run trains at its dense twin's FLOPs per step, so its budgets are the same steps
    for run in runs:
        if run.family == "tokenformer-pk16":
            twin = next(r for r in runs if r.arm == run.arm.replace("-pk16", "")
                        and r.seed == run.seed)
            assert [b.budget_index for b in run.branches] == [b.budget_index
                                                              for b in twin.branches]
            for a, b in zip(run.branches, twin.branches, strict=True):
                assert abs(a.steps - b.steps) <= 0.01 * b.steps + 1
            assert run.lr_from == run.arm  # its own sweep picks its LR


def test_product_key_config_by_hand_errors_and_arch():
    def dense(ffn: int) -> TokenFormerConfig:
        return TokenFormerConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                                 qkv_tokens=8, proj_tokens=8, ffn_tokens=ffn, max_seq_len=8,
                                 eos_token_id=None)

    # dense FFN, d = 16, n = 64: 64·(2·2·16 + 8) = 4608 FLOPs. 16×: n = 1024, s = 32; with k ≥ s
    # 2·32·16 + 32² + (8 + 2·16)·k = 2048 + 40k = 4608 at k = 64 exactly
    pk = product_key_config(dense(64), 16)
    assert (pk.ffn_tokens, pk.ffn_product_k) == (1024, 64)
    assert pk.projection_flops()[1] == dense(64).projection_flops()[1] == 4608
    # n = 4, 64×: s = 16 sub-keys cost 2·16·16 = 512 > the dense FFN's 4·72 = 288: no k fits
    with pytest.raises(ConfigError, match="no top-k"):
        product_key_config(dense(4), 64)
    assert configs_.arch("tokenformer-pk16") == "tokenformer"
    assert configs_.arch("transformer++") == "transformer++"


# ----------------------------------------------------------------------------- FLOP accounting
def _count(fn):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_product_key_flops_match_torch_flop_counter():
    """torch's counter sees the product-key FFN's sub-key matmuls (not embedding_bag): the model's
    counted matmuls are the dense attention Pattentions, the head and 2·s·d per token per layer,
    and training counts 3× forward. The value side's 2·k·d is checked on the same computation
    written as a batched matmul (weights [rows, 1, k] @ gathered values [rows, k, d])."""
    T, d, L, V = 16, 32, 2, 200
    cfg = TokenFormerConfig(vocab_size=V, hidden_size=d, num_layers=L, num_heads=2,
                            qkv_tokens=16, proj_tokens=24, ffn_tokens=100, ffn_keys="product",
                            ffn_product_k=12, max_seq_len=T, eos_token_id=None)
    s, k = 10, 12
    torch.manual_seed(0)
    model = model_class("tokenformer")(cfg)
    ids = torch.randint(0, V, (3, T))
    forward = _count(lambda: model(input_ids=ids, labels=ids)) / ids.numel()
    training = _count(lambda: model(input_ids=ids, labels=ids).loss.backward()) / ids.numel()
    attention = 2 * (3 * 16 * (d + d) + 24 * (d + d))  # from the shapes, by hand
    head = 2 * cfg.padded_vocab_size * d
    assert forward == L * (attention + 2 * s * d) + head
    assert training == 3 * forward
    # the analytic FFN = the counted sub-key scores + k'² sums + Θ over k + the value rows
    theta = THETA_FLOPS_PER_SCORE[cfg.norm]
    assert cfg.projection_flops()[1] == 2 * s * d + min(k, s) ** 2 + theta * k + 2 * k * d
    ffn = model.layers[0].mlp
    rows = torch.randn(7, d)
    from tokenformer.nn.pattention import theta as theta_fn
    from tokenformer.nn.product_keys import product_top_k

    scores, index = product_top_k(rows, ffn.sub_keys_a, ffn.sub_keys_b, k)
    weights = theta_fn(scores, cfg.norm, ffn.scale, 0.0)
    values = ffn.value_param_tokens[index]  # [rows, k, d]
    bmm = _count(lambda: torch.bmm(weights.unsqueeze(1), values)) / len(rows)
    assert bmm == 2 * k * d
    # and that bmm is the layer's output (the value part is what the count says it is)
    torch.testing.assert_close(torch.bmm(weights.unsqueeze(1), values).squeeze(1), ffn(rows))
    assert flops_per_token(cfg, T)["ffn"] == cfg.projection_flops()[1]


# ------------------------------------------------------------------------------ a tiny run
def test_sparse_preset_runs_a_few_steps_on_cpu(dataset_dir, tmp_path):
    sparse = get_preset("sparse")
    small = dataclasses.replace(
        sparse, hidden_size=32, num_layers=1, num_heads=2, base_tokens=(16, 16, 64),
        num_sizes=2, seq_len=32, batch_size=2, seeds=2, min_steps=4, sweep_steps=6,
        warmup_steps=2, eval_batches=1, num_budgets=2, lr_grid=(1e-3, 3e-3, 1e-2, 3e-2))
    per_step = configs_.model_configs(small, "tokenformer", 256)["S1"]
    per_step = configs_.sized_stage(small, "S1", per_step, 0).flops_per_step
    small = dataclasses.replace(small, max_budget=14 * per_step, budget_ratio=2.0)
    lines: list[str] = []
    results = run_.run_frontier(small, data=dataset_dir, out=tmp_path / "sparse",
                                print_fn=lines.append)
    arms = {r["arm"] for r in results["runs"].values()}
    assert arms == {f"{f}-{s}" for f in small.families for s in ("S1", "S2")}
    for run in results["runs"].values():
        # the chosen LR is the argmin of its own sweep
        sweep = results["sweeps"][run["lr_from"]]
        assert run["lr"] == sweep["chosen"] == min(
            sweep["points"], key=lambda q: (q["loss"], q["lr"]))["lr"]
        assert run["schedule"] == "wsd"
        if run["family"] == "tokenformer-pk16":
            assert run["stages"][0]["config"]["ffn_keys"] == "product"
    summary = report.summarize(results)
    questions = {c["question"] for c in summary["comparisons"]}
    assert {"tokenformer-pk16 vs tokenformer", "tokenformer-pk16 vs transformer++",
            "tokenformer vs transformer++"} <= questions
    text = (tmp_path / "sparse" / "report.md").read_text()
    assert "product-key TokenFormer (16× FFN tokens)" in text and "## Wall-clock" in text
    assert (tmp_path / "sparse" / "frontier.png").stat().st_size > 0
