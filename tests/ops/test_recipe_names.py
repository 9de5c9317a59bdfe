"""One word for growth recipes (issue 44): ``recipe`` everywhere a growth's recipe is named;
``strategy``, its old name, still works in each place it was written (``grow(strategy=)``,
``tokenformer grow --strategy``, ``--grow-at ...,strategy=``, ``register_strategy``), each time
with one deprecation warning, and it grows exactly what ``recipe`` grows. Records keep their
old key: ``tokenformer grow`` writes ``strategy`` into ``trainer_state.json`` as it always has,
and a recorded spec is read without a warning."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenformer import GrowthError, TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.errors import TokenFormerDeprecationWarning
from tokenformer.ops.growth import (
    RECIPES,
    Recipe,
    grow,
    register_strategy,
    unregister_recipe,
    unregister_strategy,
)
from tokenformer.ops.growth.tokens import zero_key_tokens
from tokenformer.training.growth_events import parse_grow_at

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "v0.1.0" / "checkpoint"


def tiny() -> TokenFormerLM:
    torch.manual_seed(0)
    return TokenFormerLM(TokenFormerConfig(vocab_size=97, hidden_size=32, num_layers=2,
                                           num_heads=4, qkv_tokens=16, proj_tokens=12,
                                           ffn_tokens=24, max_seq_len=16))


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_grow_takes_strategy_as_recipe_with_one_warning() -> None:
    model = tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling: no warning at all
        new = grow(model, ffn="2x", layers=3, recipe="paper", generator=gen())
    with pytest.warns(TokenFormerDeprecationWarning, match=r"strategy= is deprecated .* use "
                                                           r"recipe=") as caught:
        old = grow(model, ffn="2x", layers=3, strategy="paper", generator=gen())
    assert len(caught) == 1 and caught[0].filename == __file__  # blamed on the caller's line
    assert old.config == new.config
    assert all(torch.equal(v, new.state_dict()[k]) for k, v in old.state_dict().items())
    with pytest.raises(GrowthError, match="name the same thing"):
        grow(model, ffn="2x", recipe="paper", strategy="exact")


def test_register_strategy_is_register_recipe_with_a_warning() -> None:
    with pytest.warns(TokenFormerDeprecationWarning, match="use register_recipe"):
        register_strategy(Recipe("zero-keys", zero_key_tokens))
    try:
        assert RECIPES["zero-keys"].tokens is zero_key_tokens
        with pytest.warns(TokenFormerDeprecationWarning, match="use unregister_recipe"):
            unregister_strategy("zero-keys")
        assert "zero-keys" not in RECIPES
    finally:
        if "zero-keys" in RECIPES:
            unregister_recipe("zero-keys")


def _grow_cli(capsys: pytest.CaptureFixture, out: Path, *flags: str) -> list[str]:
    assert main(["grow", str(CHECKPOINT), str(out), "--ffn", "2x", *flags,
                 "--no-progress"]) == 0
    return capsys.readouterr().err.splitlines()


def test_old_spellings_warn_once_each_in_a_plain_script() -> None:
    """Python shows a DeprecationWarning only where it is blamed on ``__main__``: a script's
    ``strategy=``, old recipe name and ``--grow-at ...,strategy=`` are each shown, once (the
    warnings were blamed on the package's own lines, so a script showed none of them)."""
    script = textwrap.dedent("""
        import torch
        from tokenformer import TokenFormerConfig, TokenFormerLM
        from tokenformer.ops.growth import grow
        from tokenformer.training import TrainConfig
        model = TokenFormerLM(TokenFormerConfig(vocab_size=97, hidden_size=32, num_layers=2,
                              num_heads=4, qkv_tokens=16, proj_tokens=12, ffn_tokens=24))
        grow(model, ffn="2x", strategy="paper")
        grow(model, ffn="2x", recipe="official")
        TrainConfig(grow_at=["3:ffn=2x,strategy=paper"])
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    shown = [line for line in run.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(shown) == 3, run.stderr
    assert all(line.startswith("<string>:") for line in shown), shown  # the script's lines
    assert sum("strategy= is deprecated" in line for line in shown) == 2
    assert sum("'official' is now called 'official-init'" in line for line in shown) == 1


def test_the_grow_command_refuses_recipe_and_strategy_together(tmp_path, capsys):
    assert main(["grow", str(CHECKPOINT), str(tmp_path / "out"), "--ffn", "2x", "--recipe",
                 "exact", "--strategy", "paper", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: grow: recipe and strategy (its old name) name the same "
                              "thing"), err
    assert not (tmp_path / "out").exists()


def test_the_grow_commands_strategy_flag_is_recipe_with_one_warning_line(tmp_path, capsys):
    assert _grow_cli(capsys, tmp_path / "new", "--recipe", "paper") == []
    err = _grow_cli(capsys, tmp_path / "old", "--strategy", "paper")
    assert len(err) == 1 and err[0].startswith("warning: --strategy is deprecated"), err
    assert "use --recipe" in err[0]
    old, new = (load_file(tmp_path / d / "model.safetensors") for d in ("old", "new"))
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    for folder in ("old", "new"):  # the record keeps the key it has always had
        grown = json.loads((tmp_path / folder / "trainer_state.json").read_text())["grown"][-1]
        assert grown["strategy"] == "paper" and "recipe" not in grown


def test_the_grow_at_key_strategy_warns_once_on_the_command_line(tmp_path, capsys):
    """Two growths spelled the old way: one warning line (then the step 7 of a 5-step run is
    refused in its one error line, before anything is written)."""
    out = tmp_path / "run"
    code = main(["train", "--config", "tiny", "--out", str(out), "--steps", "5",
                 "--grow-at", "2:ffn=2x,strategy=paper", "--grow-at", "7:ffn=2x,strategy=paper"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and not out.exists()
    assert [line.split(":")[0] for line in err] == ["warning", "error"], err
    assert "--grow-at ...,strategy= is deprecated" in err[0] and "recipe=" in err[0]


def test_a_spec_with_the_old_key_is_the_same_growth_and_a_recorded_one_is_silent():
    with pytest.warns(TokenFormerDeprecationWarning):
        old = parse_grow_at("4:ffn=2x,strategy=official-released")
    new = parse_grow_at("4:ffn=2x,recipe=official-released")
    assert old.kwargs == new.kwargs == {"ffn": "2x", "recipe": "official-released"}
    assert old.lr_stage == new.lr_stage and old.lr_stage.restart
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recorded = parse_grow_at("4:ffn=2x,strategy=official-released", recorded=True)
    assert recorded.kwargs == new.kwargs
