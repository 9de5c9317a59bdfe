"""One override syntax: ``--model.KEY VALUE`` on every command that takes config overrides
(``train`` and ``vision train``); ``vision train --set KEY=VALUE`` still works and says, once, that
it is deprecated."""

from __future__ import annotations

import json

import pytest

from tokenformer.cli import main

pytest.importorskip("sklearn")  # the digits

FAST = ["vision", "train", "--steps", "2", "--batch-size", "8", "--no-progress"]


def trained(capsys, tmp_path, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "run"
    assert main([*FAST, *flags, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    config = json.loads((out / "final" / "config.json").read_text())
    return config, err


def test_vision_model_overrides_are_typed_model_keys(capsys, tmp_path):
    config, err = trained(capsys, tmp_path, "--model.pool", "cls", "--model.qkv_tokens", "12")
    assert config["pool"] == "cls" and config["qkv_tokens"] == 12  # an int, not the string "12"
    assert "deprecated" not in err


def test_vision_set_is_a_deprecated_alias(capsys, tmp_path):
    config, err = trained(capsys, tmp_path, "--set", "pool=cls", "--set", "qkv_tokens=12")
    assert config["pool"] == "cls" and config["qkv_tokens"] == 12
    assert err.count("warning: --set is deprecated, use --model.KEY VALUE") == 1


def test_vision_model_override_of_a_wrong_type_is_one_error_line(capsys):
    assert main([*FAST, "--model.qkv_tokens", "many"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.qkv_tokens" in err and err.count("\n") == 1
