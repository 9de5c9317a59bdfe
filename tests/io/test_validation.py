"""Issue 27, sections 3 and 6 (in part), replayed: no exit 0 with an output nothing can use, and
one clear line for every bad input.

Each test replays a case the issue found and asserts the outcome it asks for: exit 2 (or the
signal's 128 + N) and exactly one ``error:`` line naming what is wrong, no traceback and no
output written; or, where the command should work, that it does and computes what it should.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from test_run_folders import run  # the CLI in-process: (exit code, stdout, stderr)

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.errors import CheckpointError, ConfigError
from tokenformer.models.baselines import TransformerConfig
from tokenformer.models.vit import TokenFormerViTConfig, ViTConfig
from tokenformer.ops import adapters as ad

ENOSPC_MESSAGE = "Error while serializing: I/O error: No space left on device (os error 28)"


# ------------------------------------------------------------------------------------ helpers
def refused(capsys, *argv: object, match: str, code: int = 2) -> str:
    """The command fails with exactly one ``error:`` line containing ``match`` and exit 2."""
    got, _, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert got == code, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert match in lines[0], lines[0]
    return lines[0]


def one_error_line(err: str) -> str:
    """The one ``error:`` line of ``err``, its last (``scale`` reports progress on stderr)."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert errors == lines[-1:] and "Traceback" not in err, err
    return lines[-1]


def tiny(**overrides) -> TokenFormerLM:
    torch.manual_seed(0)
    return TokenFormerLM(TokenFormerConfig.from_name("tiny", **overrides))


PRODUCT = {"ffn_keys": "product", "ffn_tokens": 64, "ffn_product_k": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny().save(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def bpe_datasets(tmp_path_factory) -> dict[int, Path]:
    """Prepared datasets of a small text with 300- and 1000-token BPE vocabularies: too many
    tokens for the 257-token tiny model (whose embedding has 384 rows)."""
    from tokenformer.data.corpus import kjv_text
    from tokenformer.data.prepare import prepare

    root = tmp_path_factory.mktemp("bpe")
    (root / "text.txt").write_text(kjv_text()[:60_000])
    return {v: prepare(root / "text.txt", f"bpe:{v}", root / f"bpe{v}", val_fraction=0.1,
                       progress=False).path for v in (300, 1000)}


# ====================================================== section 3: exit 0, output unusable
@pytest.mark.parametrize("overrides, named", [
    (PRODUCT, "ffn_keys=product"),
    ({"ffn_top_k": 0.5}, "ffn_top_k=0.5"),
    ({"qkv_top_k": 4}, "qkv_top_k=4"),
])
def test_to_official_refuses_what_its_config_json_cannot_carry(capsys, tmp_path, overrides,
                                                               named):
    """Before: a folder whose config.json dropped ffn_keys (every loader then failed on "missing
    key") or the top-k settings (another function), exit 0."""
    pytest.importorskip("transformers")
    tiny(**overrides).save(tmp_path / "m")
    line = refused(capsys, "convert", "to-official", tmp_path / "m", tmp_path / "o",
                   match="the official layout cannot express")
    assert named in line and line.endswith("use to-hf")
    assert not (tmp_path / "o").exists()


def test_every_config_field_is_carried_by_the_official_layout_or_checked():
    """A field the official config.json does not carry and that changes the function is
    reported whenever it is not its default: derived from the dataclass, so a new field is
    covered without editing a list."""
    from tokenformer.models.official import OFFICIAL_KEYS, inexpressible

    changed = {"rotary_base": 500.0, "theta_eps": 1e-6, "qkv_scale": 2.0, "proj_scale": 2.0,
               "ffn_scale": 2.0, "qkv_top_k": 4, "proj_top_k": 0.5, "ffn_top_k": 8,
               "layernorm_eps": 1e-6, "block_norm": "both", "ffn_keys": "product",
               "tie_embeddings": False}
    others = {f.name for f in dataclasses.fields(TokenFormerConfig)} - set(OFFICIAL_KEYS)
    assert others - set(changed) == {"ffn_product_k", "init_std", "name"}
    for key, value in changed.items():
        extra = {"ffn_tokens": 64} if key == "ffn_keys" else {}
        config = TokenFormerConfig.from_name("tiny", **{key: value}, **extra)
        assert [r.split("=")[0] for r in inexpressible(config)] == [key], key
    # ... and nothing for what the official code computes the same way
    assert inexpressible(TokenFormerConfig.from_name("tiny", init_std=0.1, ffn_product_k=4)) == []


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("key, value, allowed", [
    ("theta_eps", NAN, "a finite number >= 0"),
    ("layernorm_eps", -1e-5, "a positive finite number"),
    ("layernorm_eps", NAN, "a positive finite number"),
    ("qkv_scale", INF, "a positive finite number or null"),
    ("qkv_scale", -INF, "a positive finite number or null"),
    ("rotary_base", 0, "a positive finite number"),
    ("rotary_base", -10000.0, "a positive finite number"),
    ("eos_token_id", "0", "an integer >= 0 or null"),
    ("eos_token_id", -1, "an integer >= 0 or null"),
    ("rotary_pct", "0.25", "a finite number in [0, 1]"),
    ("init_std", NAN, "a finite number >= 0"),
    ("name", 5, "a string"),
    ("ffn_top_k", "all", "a token count >= 1 or a fraction in (0, 1] or null"),
])
def test_model_config_values_are_checked_when_read(capsys, tmp_path, model_dir, key, value,
                                                   allowed):
    """Before: garbage text or a raw RuntimeError/TypeError, often with exit 0."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))  # NaN as JSON does
    line = refused(capsys, "generate", folder, "--prompt", "ab", "--max-new-tokens", "2",
                   match=f"config: {key} must be {allowed}, got ")
    assert line.endswith(repr(value)), line


# One field of each type a model config has, given a value of the wrong type: every field of
# every model config class is checked by the one routine (config.check_fields).
@pytest.mark.parametrize("cls", [TokenFormerConfig, TransformerConfig, TokenFormerViTConfig,
                                 ViTConfig])
def test_every_field_of_every_model_config_is_type_checked(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    assert len(fields) >= 10
    for name in fields:
        with pytest.raises(ConfigError, match=rf"^config: {name} must be .*, got \[1\]$"):
            cls(**{name: [1]})


def test_yaml_config_exponents_are_numbers(tmp_path):
    """The stricter types must not refuse ``layernorm_eps: 1e-5`` (a string to YAML 1.1, which
    PyYAML follows, and a number to YAML 1.2 and JSON); a quoted '1e-5' stays a string."""
    text = "\n".join(f"{k}: {v}" for k, v in TokenFormerConfig.from_name("tiny").to_dict().items()
                     if v is not None and k != "layernorm_eps")
    (tmp_path / "c.yaml").write_text(text + "\nlayernorm_eps: 1e-5\n")
    assert TokenFormerConfig.load(tmp_path / "c.yaml").layernorm_eps == 1e-5
    (tmp_path / "c.yaml").write_text(text + "\nlayernorm_eps: '1e-5'\n")
    with pytest.raises(ConfigError, match="layernorm_eps must be a positive finite number"):
        TokenFormerConfig.load(tmp_path / "c.yaml")


@pytest.mark.parametrize("cls, key, value", [
    (TransformerConfig, "layernorm_eps", NAN),
    (TransformerConfig, "rotary_base", 0.0),
    (TransformerConfig, "init_std", -0.02),
    (TransformerConfig, "eos_token_id", "0"),
    (TokenFormerViTConfig, "theta_eps", NAN),
    (TokenFormerViTConfig, "layernorm_eps", -1.0),
    (ViTConfig, "init_std", INF),
])
def test_baseline_and_vision_configs_check_ranges_too(cls, key, value):
    with pytest.raises(ConfigError, match=rf"^config: {key} must be "):
        cls(**{key: value})


@pytest.mark.parametrize("vocab", [300, 1000])
def test_prune_calibration_data_must_fit_the_vocabulary_as_adapt_says(capsys, tmp_path,
                                                                      model_dir, bpe_datasets,
                                                                      vocab):
    """Before: prune calibrated on out-of-vocabulary ids with exit 0 (bpe:300) or ended in
    "IndexError: index out of range in self" (bpe:1000), where adapt refused the same data.
    Now prune, adapt and eval refuse it with the same line (one check)."""
    from tokenformer.data.datasets import TokenDataset

    data = bpe_datasets[vocab]
    want = (f"the data at {data} uses a {vocab}-token vocabulary "
            f"({TokenDataset.open(data).meta['tokenizer']}) but the model has only 257")
    lines = [refused(capsys, "prune", model_dir, tmp_path / "p", "--ffn", "64", "--data", data,
                     match=want),
             refused(capsys, "adapt", model_dir, "--data", data, "--tokens", "ffn=2", "--out",
                     tmp_path / "a", "--steps", "1", "--no-progress", match=want),
             refused(capsys, "eval", model_dir, "--data", data, "--no-progress", match=want)]
    assert len(set(lines)) == 1
    assert not (tmp_path / "p").exists() and not (tmp_path / "a").exists()


def test_prune_default_corpus_with_a_larger_tokenizer_is_refused(capsys, tmp_path, model_dir,
                                                                bpe_datasets, monkeypatch):
    """``prune --tokenizer bpe:300``: the embedded corpus prepared with it (stood in for by the
    small BPE dataset: preparing the whole corpus takes a while) is checked the same way."""
    from tokenformer.data import corpus, datasets

    asked = []
    monkeypatch.setattr(corpus, "default_dataset", lambda tokenizer, **kw: (
        asked.append(tokenizer), datasets.TokenDataset.open(bpe_datasets[300]))[1])
    refused(capsys, "prune", model_dir, tmp_path / "p", "--ffn", "64", "--tokenizer", "bpe:300",
            match=f"the data at {bpe_datasets[300]} uses a 300-token vocabulary")
    assert asked == ["bpe:300"] and not (tmp_path / "p").exists()


def test_merge_of_attention_adapters_on_a_product_key_base(capsys, tmp_path):
    """Before: "TokenFormerLM has no ffn Pattentions to adapt". The merged model computes the
    adapted function; its product-key FFN is the base's, untouched."""
    base = tiny(**PRODUCT, max_seq_len=32)
    base.save(tmp_path / "base")
    model = TokenFormerLM.load(tmp_path / "base")
    ad.adapt(model, qkv=3, proj=2, name="attn", generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # adapter keys away from zero: the adapted function differs
        for name, p in model.named_parameters():
            if ".adapters." in name:
                p.copy_(torch.randn_like(p) * 0.5)
    ad.save_adapter(model, "attn", tmp_path / "adapter")
    assert run(capsys, "merge", tmp_path / "base", "--adapter", tmp_path / "adapter", "--out",
               tmp_path / "merged")[0] == 0
    merged = TokenFormerLM.load(tmp_path / "merged")
    c = merged.config
    assert (c.qkv_tokens, c.proj_tokens, c.ffn_tokens, c.ffn_keys) == (35, 34, 64, "product")
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        adapted, plain = model(x).logits, base(x).logits
        torch.testing.assert_close(merged(x).logits, adapted, rtol=0, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-3  # the adapter did change the function
    for name, tensor in base.state_dict().items():
        if ".mlp." in name:
            assert torch.equal(merged.state_dict()[name], tensor), name


# ================================================================= section 6: one clear line
@pytest.mark.parametrize("argv, match", [
    (["adapt", "{m}", "--data", "default", "--tokens", "ffn=²", "--out", "{tmp}/a"], "--tokens"),
    (["prune", "{m}", "{tmp}/p", "--ffn", "²"], "malformed size '²'"),
    (["grow", "{m}", "--out", "{tmp}/g", "--ffn", "²"], "malformed size '²'"),
    (["grow", "{m}", "--out", "{tmp}/g", "--layers", "²"], "malformed size '²'"),
    (["train", "--config", "tiny", "--out", "{tmp}/r", "--grow-at", "2:ffn=²"], "ffn='²'"),
    (["train", "--config", "tiny", "--out", "{tmp}/r", "--grow-at", "²:ffn=2x"], "malformed"),
])
def test_superscript_digits_are_malformed_sizes(capsys, tmp_path, model_dir, argv, match):
    """'²'.isdigit() is True but int('²') fails: before, a ValueError."""
    line = refused(capsys, *(a.format(m=model_dir, tmp=tmp_path) for a in argv), match=match)
    assert "ValueError" not in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["train", "--config", "tiny", "--out", "{tmp}/r", "--steps", "1", "--samples", "0"],
    ["adapt", "{m}", "--data", "default", "--tokens", "ffn=2", "--out", "{tmp}/a", "--steps",
     "1"],
    ["generate", "{m}", "--prompt", "a"],
    ["eval", "{m}", "--data", "{m}/config.json"],
    ["scale", "--out", "{tmp}/s"],
])
def test_unknown_device_is_one_line_on_every_command(capsys, tmp_path, model_dir, argv):
    """Before: train and adapt ended in torch's RuntimeError listing every device type."""
    line = refused(capsys, *(a.format(m=model_dir, tmp=tmp_path) for a in argv), "--device",
                   "bogus", match="unknown device 'bogus' (use cpu, cuda, cuda:N or mps)")
    assert "RuntimeError" not in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, value, match", [
    ("--beta1", "2", "beta1 must be a finite number in [0, 1), got 2.0"),
    ("--beta1", "-0.1", "beta1 must be a finite number in [0, 1), got -0.1"),
    ("--beta2", "1", "beta2 must be a finite number in [0, 1), got 1.0"),
    ("--eps", "-1e-8", "eps must be a finite number >= 0, got -1e-08"),
])
@pytest.mark.parametrize("command", ["train", "adapt"])
def test_optimizer_hyper_parameters_are_checked_before_anything_is_written(
        capsys, tmp_path, model_dir, command, option, value, match):
    """Before: AdamW's raw ValueError, after train had created the run folder."""
    argv = (["train", "--config", "tiny", "--out", tmp_path / "r", "--steps", "1"]
            if command == "train" else
            ["adapt", model_dir, "--data", "default", "--tokens", "ffn=2", "--out", tmp_path / "a",
             "--steps", "1"])
    refused(capsys, *argv, f"{option}={value}", match=match)  # =: "-1e-8" is no option
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------- damaged experiment state
def _tiny_frontier(vocab: int):
    """A one-family frontier preset small enough for the 200 kB test corpus."""
    from tokenformer.experiments.frontier import plan as plan_
    from tokenformer.experiments.frontier import presets as presets_

    preset = dataclasses.replace(
        presets_.FULL_V3, name="tiny", hidden_size=32, num_layers=1, num_heads=2,
        base_tokens=(16, 16, 64), num_sizes=2, seq_len=32, batch_size=4, max_budget=1.2e9,
        num_budgets=2, warmup_steps=2, min_steps=8, sweep_steps=12, anneal_steps=3,
        eval_batches=1, seeds=1, tuning_seeds=1, lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
        families=("tokenformer",), recipes=("chain-exact",), questions=())
    return preset, plan_.sweep_plan(preset, vocab)


def _torch_file(kind: str) -> bytes:
    import argparse
    import io

    buffer = io.BytesIO()
    if kind == "not weights":  # a pickled object weights_only refuses (torch's advice follows)
        torch.save({"lr": 1e-3, "cursor": argparse.Namespace(step=1)}, buffer)
    else:  # loads, but is not a state this command writes
        torch.save({"lr": 1e-3, "cursor": 0}, buffer)
    data = buffer.getvalue()
    return data[: len(data) // 2] if kind == "truncated" else data


def _run_record(run, lr: float, **edit) -> bytes:
    """The record ``execute`` writes for a finished ``run`` at ``lr`` (made-up losses), its
    branches at the planned budgets; ``edit``: ``keep`` (the first so many branches), or
    ``budget`` / ``budget_index`` (the last branch's value), or ``duplicate`` (its last branch
    twice)."""
    branches = [{"budget_index": b.budget_index, "budget": b.budget, "steps": b.steps,
                 "decay_start": b.decay_start, "flops": b.flops, "tokens": 0,
                 "size": run.stages[-1].size, "loss": 3.0, "bpb": 1.5} for b in run.branches]
    branches = branches[:edit.pop("keep", len(branches))]
    if edit.pop("duplicate", False):
        branches.append(dict(branches[-1]))
    branches[-1].update(edit)
    return json.dumps({"lr": lr, "branches": branches,
                       "timing": {"train_time": 1.0, "step_time": {}, "wall": 1.0}}).encode()


@pytest.mark.parametrize("where, content", [
    ("runs", b"{not json"),
    ("runs", b"[]"),
    ("runs", b'{"lr": LR}'),
    ("runs", b"\xff\xfe"),
    # issue 42: records whose budgets are not the plan's were taken as the run's results
    pytest.param("runs", {"budget": 5.0}, id="runs-budget-edited"),
    pytest.param("runs", {"budget_index": 1}, id="runs-budget-not-planned"),
    pytest.param("runs", {"duplicate": True}, id="runs-budget-twice"),
    ("state", b""),
    ("state", b"PK\x03\x04 garbage"),
    ("state", "truncated"),
    ("state", "not weights"),
    ("state", "other dict"),
])
def test_damaged_scale_state_is_one_line_naming_the_file(capsys, tmp_path, dataset_dir,
                                                         monkeypatch, where, content):
    """Before: an empty EOFError, miniz errors, torch's advice to load with weights_only=False,
    JSONDecodeError, AttributeError or KeyError."""
    import tokenformer.cli.commands.scale as scale_command
    from tokenformer.data.datasets import TokenDataset
    from tokenformer.experiments.frontier import state as state_
    from tokenformer.io.outputs import write_marker

    preset, sweeps = _tiny_frontier(TokenDataset.open(dataset_dir).vocab_size)
    monkeypatch.setattr(scale_command, "get_preset", lambda name, **kw: preset)
    out = tmp_path / "s"
    for sweep in sweeps:  # whichever runs first finds its file damaged
        path = out / where / (state_._safe(sweep.id) + (".json" if where == "runs" else ".pt"))
        path.parent.mkdir(parents=True, exist_ok=True)
        data = content.replace(b"LR", str(sweep.lr).encode()) if isinstance(content, bytes) \
            else _run_record(sweep, sweep.lr, **content) if isinstance(content, dict) \
            else _torch_file(content)
        path.write_bytes(data)
    write_marker(out, "scale")  # as the interrupted earlier scale left it
    code, _, err = run(capsys, "scale", "--data", dataset_dir, "--out", out, "--no-progress")
    line = one_error_line(err)
    assert code == 2
    assert f"{out / where}{os.sep}" in line and " is damaged (" in line
    assert "; delete it to rerun that arm (sweep/" in line
    assert "weights_only" not in line and "Error:" not in line.split(" is damaged")[0]


def test_a_run_record_without_every_planned_budget_is_damaged(tmp_path):
    """Issue 42: ``scale --preset quick`` (v3's, now ``quick-v3``) with 2 of the 4 branches of
    ``runs/chain-paper__seed0.json`` kept, or a budget edited to 5.0, took the record as the
    run's results (exit 0, nothing retrained, G1 answered at 3.8e11 FLOPs instead of 1.5e12).
    A record must hold each budget its arm plans once, at the planned FLOPs."""
    from types import SimpleNamespace

    from tokenformer.experiments.frontier import plan as plan_
    from tokenformer.experiments.frontier import presets as presets_
    from tokenformer.experiments.frontier import state as state_

    quick = presets_.get_preset("quick-v3")
    chain = next(r for r in plan_.plan(quick, 256, 4_000_000) if r.id == "chain-paper/seed0")
    assert [b.budget for b in chain.branches] == [1.875e11, 3.75e11, 7.5e11, 1.5e12]
    ctx, lrs = SimpleNamespace(out=tmp_path), (1e-3,) * len(chain.stages)
    path = tmp_path / "runs" / "chain-paper__seed0.json"
    path.parent.mkdir()
    path.write_bytes(_run_record(chain, 1e-3))
    assert [b["budget"] for b in state_.saved_result(ctx, chain, lrs)["branches"]] == [
        1.875e11, 3.75e11, 7.5e11, 1.5e12]  # the whole record: the run's results, as before
    for edit, detail in [
        ({"keep": 2}, "it holds 2 of the 4 budgets its arm plans; missing: budget 2 "
                      "(7.5e+11 FLOPs), budget 3 (1.5e+12 FLOPs)"),
        ({"budget": 5.0}, "its budget 3 is 5.0 FLOPs, the plan's 1500000000000.0"),
        ({"budget": 1.5e12 * (1 + 2 ** -52)},
         "its budget 3 is 1500000000000.0002 FLOPs, the plan's 1500000000000.0"),
        ({"budget_index": 4}, "it holds a branch at budget 4, which its arm does not plan (it "
                              "plans 0, 1, 2, 3)"),
        ({"budget_index": "3"}, "it holds a branch at budget '3', which its arm does not plan"),
        ({"keep": 3, "duplicate": True}, "it holds budget 2 twice"),
    ]:
        path.write_bytes(_run_record(chain, 1e-3, **edit))
        with pytest.raises(CheckpointError) as info:
            state_.saved_result(ctx, chain, lrs)
        assert str(info.value).startswith(f"{path} is damaged ({detail}"), edit
        assert str(info.value).endswith("); delete it to rerun that arm (chain-paper/seed0)")
    assert state_.saved_result(ctx, chain, (2e-3,) * len(chain.stages)) is None  # another LR's run:
    # trained again and replaced, as before


@pytest.mark.parametrize("content", [b"", b"{", b"[1]", b'{"curves": []}',
                                     b'{"fingerprint": "FP", "curves": {"a": {"0": {}}}}',
                                     b'{"fingerprint": "FP", "curves": {"a": {"x": '
                                     b'{"points": [], "events": []}}}}'])
def test_damaged_partial_results_of_ablate_are_one_line(tmp_path, content):
    """``.partial.json`` of ablate (common.run_arms): before, JSONDecodeError, AttributeError,
    KeyError or TypeError."""
    from tokenformer.experiments.common import Arm, fingerprint, run_arms

    partial = tmp_path / ".partial.json"
    partial.write_bytes(content.replace(b"FP", fingerprint({"x": 1}).encode()))
    with pytest.raises(CheckpointError) as info:
        run_arms([Arm("a", lambda seed, shared: pytest.fail("ran"))], [0], partial=partial,
                 settings={"x": 1}, progress=False)
    message = str(info.value)
    assert message.startswith(f"{partial} is damaged (") and "\n" not in message
    assert message.endswith("; delete it to rerun the runs it records")


@pytest.mark.parametrize("content", [b"{", b"[]", b'{"runs": {"k": {"arm": "full"}}}'])
def test_damaged_partial_results_of_adapt_bench_fail_before_pretraining(tmp_path, content,
                                                                         monkeypatch):
    from tokenformer.experiments import adapt_bench
    from tokenformer.experiments.adapt_bench import run as adapt_bench_run

    monkeypatch.setattr(adapt_bench_run, "kjv_dataset", lambda progress: pytest.fail("pretrained"))
    (tmp_path / ".partial.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"\.partial\.json is damaged \(.*\); delete it"):
        adapt_bench.run_adapt_bench("test", out=tmp_path, progress=False)


# ------------------------------------------------------------------------ SIGTERM: adapt, scale
@pytest.fixture
def sigterm_at_step_2(monkeypatch):
    """The trainer sends this process SIGTERM after its second step (mid-training, as from a
    scheduler, at a reproducible point). Until the command installs its own handler, SIGTERM
    fails the test instead of killing pytest (what it did to the command before: exit 143, not
    a word)."""
    import tokenformer.experiments.frontier.one_run as frontier_run
    import tokenformer.training.adapt as adapt_command
    from tokenformer.training import loop

    real = loop.fit

    def fit(*args, **kwargs):
        def stop(record, model):
            if record["type"] == "train" and record["step"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        kwargs["callbacks"] = [*kwargs.get("callbacks", ()), stop]
        return real(*args, **kwargs)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM not handled by the command (it would have died silently)")

    for module in (adapt_command, frontier_run):  # where adapt and scale call it
        monkeypatch.setattr(module, "fit", fit)
    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_during_adapt_says_what_was_kept(capsys, tmp_path, model_dir, dataset_dir,
                                                 sigterm_at_step_2):
    out = tmp_path / "adapter"
    line = refused(capsys, "adapt", model_dir, "--data", dataset_dir, "--tokens", "ffn=2",
                   "--out", out, "--steps", "50", "--batch-size", "2", "--seq-len", "16",
                   "--eval-batches", "1", "--no-progress", code=128 + signal.SIGTERM,
                   match="error: interrupted by SIGTERM: ")
    assert line == (f"error: interrupted by SIGTERM: nothing was written to {out} (an adapter is "
                    f"saved when its training ends); rerun the same command to train it")
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_scale_says_what_was_kept(capsys, tmp_path, dataset_dir, monkeypatch,
                                                 sigterm_at_step_2):
    import tokenformer.cli.commands.scale as scale_command
    from tokenformer.data.datasets import TokenDataset

    preset, _ = _tiny_frontier(TokenDataset.open(dataset_dir).vocab_size)
    monkeypatch.setattr(scale_command, "get_preset", lambda name, **kw: preset)
    out = tmp_path / "s"
    code, _, err = run(capsys, "scale", "--data", dataset_dir, "--out", out, "--no-progress")
    assert code == 128 + signal.SIGTERM, err
    assert one_error_line(err) == (
        f"error: interrupted by SIGTERM: finished runs are kept in {out / 'runs'} and the run "
        f"in progress at its last branch or growth point in {out / 'state'}; rerun the same "
        f"command to resume")


def test_another_experiment_names_the_setting_that_differs(capsys, tmp_path, dataset_dir,
                                                          monkeypatch):
    """Issue 42: a folder started with ``--jobs 2`` (one thread per run) and rerun without it
    was "another experiment (other preset, data, threads or compile mode)", not saying which."""
    import tokenformer.cli.commands.scale as scale_command
    from tokenformer.data.datasets import TokenDataset
    from tokenformer.experiments.frontier import run as run_

    preset, _ = _tiny_frontier(TokenDataset.open(dataset_dir).vocab_size)
    monkeypatch.setattr(scale_command, "get_preset", lambda name, **kw: preset)

    def stop(*args, **kwargs):  # experiment.json is written: the folder is this experiment's
        raise KeyboardInterrupt

    monkeypatch.setattr(run_, "run_sweeps", stop)
    out, threads = tmp_path / "s", torch.get_num_threads()
    argv = ("scale", "--data", dataset_dir, "--out", out, "--no-progress")
    try:
        assert run(capsys, *argv, "--jobs", "2")[0] == 130
        code, _, err = run(capsys, *argv, "--threads", "2")
    finally:
        torch.set_num_threads(threads)
    assert code == 2
    assert one_error_line(err) == (
        f"error: {out} holds another experiment: threads is 1 there, 2 in this call (--threads; "
        f"--jobs N runs one thread); rerun it as it was started, choose another --out or "
        f"delete it")


# ------------------------------------------------------------------ disk full: scale, convert
UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 191872 vs 191760"


@pytest.mark.parametrize("where", ["state", "runs"])
def test_disk_full_during_scale_names_the_file_and_how_to_resume(capsys, tmp_path, dataset_dir,
                                                                 monkeypatch, where):
    """Issue 42: before, a bare "no space left on device". A state file (torch's zip writer
    reports a full disk as "unexpected pos") or a finished run's record (an OSError without a
    file name, as a failed write has) cannot be written."""
    import errno

    import tokenformer.cli.commands.scale as scale_command
    from tokenformer.data.datasets import TokenDataset

    preset, sweeps = _tiny_frontier(TokenDataset.open(dataset_dir).vocab_size)
    monkeypatch.setattr(scale_command, "get_preset", lambda name, **kw: preset)
    if where == "state":
        def save(*args, **kwargs):
            raise RuntimeError(UNEXPECTED_POS)

        monkeypatch.setattr(torch, "save", save)
    else:
        write_text = Path.write_text

        def full(self, *args, **kwargs):
            if self.parent.name == "runs":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "s"
    code, _, err = run(capsys, "scale", "--data", dataset_dir, "--out", out, "--no-progress")
    assert code == 2
    first = sweeps[0].id.replace("/", "__") + (".pt" if where == "state" else ".json")
    assert one_error_line(err) == (
        f"error: no space left on device writing {out / where / first}; finished runs are kept "
        f"in {out / 'runs'} and the run in progress at its last branch or growth point in "
        f"{out / 'state'}; free space and rerun the same command to resume")
    assert not [p for p in out.rglob("*.tmp")]  # no temporary file left behind


def test_disk_full_during_convert_to_hf_names_the_output(capsys, tmp_path, model_dir):
    """Issue 42: before, transformers' "Writing model shards" bar, half drawn, then a bare "no
    space left on device". transformers writes the weights with safetensors itself."""
    pytest.importorskip("transformers")
    from safetensors import SafetensorError
    from transformers import modeling_utils

    def save_file(*args, **kwargs):
        raise SafetensorError(ENOSPC_MESSAGE)

    out = tmp_path / "hf"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_utils, "safe_save_file", save_file)
        line = refused(capsys, "convert", "to-hf", model_dir, out, match="error: no space")
    assert line == (f"error: no space left on device writing {out}; nothing was written; free "
                    f"space and rerun the same command")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ disk full in safetensors
@pytest.fixture
def disk_full(monkeypatch):
    """Every safetensors write fails as safetensors reports a full disk (os error 28)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def save_file(*args, **kwargs):
        raise SafetensorError(ENOSPC_MESSAGE)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def test_disk_full_in_a_safetensors_write_says_so(capsys, tmp_path, model_dir, disk_full):
    """Before: "SafetensorError: Error while serializing: ..." instead of the documented line."""
    line = refused(capsys, "prune", model_dir, tmp_path / "p", "--ffn", "64", "--by", "value",
                   match="error: no space left on device writing ")
    assert "model.safetensors" in line
    assert list(tmp_path.iterdir()) == []


def test_every_safetensors_write_raises_enospc(tmp_path, disk_full):
    """Model, adapter and trainer-state files (the trainer turns ENOSPC into its "no space left
    on device while writing the checkpoint" line)."""
    import errno

    from tokenformer.io.tree import save_tree

    model = tiny()
    ad.adapt(model, ffn=2, name="a")
    writes = {"model": lambda: model.save(tmp_path / "m"),
              "adapter": lambda: ad.save_adapter(model, "a", tmp_path / "a"),
              "tree": lambda: save_tree(tmp_path / "t.safetensors", {"x": torch.zeros(2)})}
    for what, write in writes.items():
        with pytest.raises(OSError) as info:
            write()
        assert info.value.errno == errno.ENOSPC, what
        assert str(tmp_path) in info.value.filename, what
    assert not (tmp_path / "a").exists() and not (tmp_path / "t.safetensors").exists()


def test_disk_full_through_transformers_is_said_too():
    """``convert to-hf`` writes through transformers, which calls safetensors itself: the CLI's
    one line recognises safetensors' error as well."""
    from safetensors import SafetensorError

    from tokenformer.cli import describe_failure
    from tokenformer.errors import is_disk_full

    assert describe_failure(SafetensorError(ENOSPC_MESSAGE)) == "no space left on device"
    assert not is_disk_full(SafetensorError("Error while deserializing header: (os error 2)"))
    # tokenizers (tokenizer.json of a conversion) raises a plain Exception in the same words
    assert is_disk_full(Exception("No space left on device (os error 28)"))
    assert not is_disk_full(Exception("No such file or directory (os error 2)"))
