"""--init-from folders that are not what their config.json says, through `flashfsdp-train`'s own
entry point (in this process: it answers before launching any worker): a truncated or garbled
safetensors file, and config.json fields of the wrong JSON type or sign, are one line naming the
file or field, exit code 2. Tied embeddings follow transformers: a tied config.json whose weights
hold an lm_head.weight of other values keeps both, untied, with a warning, and one whose weights
hold only lm_head.weight ties to it; either way the model computes what transformers' does from
the same folder."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from flashfsdp.train.config import TrainConfig  # noqa: E402
from flashfsdp.train.precision import Precision  # noqa: E402
from flashfsdp.train.pretrained import load_pretrained  # noqa: E402
from flashfsdp.train.sharding import build_sharded_model  # noqa: E402
from flashfsdp_cli.train import main  # noqa: E402
from tests.train.test_init_from import _copy_with as _copy, pretrained  # noqa: E402, F401 - the fixture

FP32 = Precision.from_names("fp32", "fp32").policy


def _one_line_error(capsys, folder: str, tmp_path) -> str:
    code = main(["--init-from", folder, "--steps", "1", "--nproc", "1", "--eval-batches", "1", "--sample-tokens", "0",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    return err[0]


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_damaged_safetensors_file_is_named(pretrained, tmp_path, capsys, damage):
    folder = _copy(pretrained, tmp_path, damage)
    weights = os.path.join(folder, "model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as fh:
        fh.write(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 64 + data[64:])
    line = _one_line_error(capsys, folder, tmp_path)
    assert line.startswith(f"flashfsdp-train: error: --init-from {folder}: {weights} is not a readable "
                           "safetensors file ("), line
    assert line.endswith("it is truncated or damaged: save or download it again"), line


@pytest.mark.parametrize("changes, message", [
    ({"intermediate_size": "64"}, 'intermediate_size must be a positive integer, got "64" (a JSON string)'),
    ({"hidden_size": -32}, "hidden_size must be a positive integer, got -32 (a JSON integer)"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer, got 2.0 (a JSON number)"),
    ({"num_key_value_heads": "2"}, 'num_key_value_heads must be a positive integer (or null), got "2" (a JSON string)'),
    ({"rms_norm_eps": "1e-6"}, 'rms_norm_eps must be a positive number, got "1e-6" (a JSON string)'),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}},
     "rope_parameters.rope_theta must be a positive number, got -1 (a JSON integer)"),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false, got "false" (a JSON string)'),
])
def test_config_fields_of_the_wrong_type_or_sign_are_one_line(pretrained, tmp_path, capsys, changes, message):
    folder = _copy(pretrained, tmp_path, "changed", **changes)
    line = _one_line_error(capsys, folder, tmp_path)
    assert line == (f"flashfsdp-train: error: --init-from {folder}/config.json: {message}; fix it in "
                    "config.json"), line


def _tied_folder(pretrained, tmp_path, name: str, keep_embedding: bool) -> str:
    """The pretrained folder with a tied config.json, its weights holding the (different)
    lm_head.weight beside the embedding, or instead of it."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    folder = _copy(pretrained, tmp_path, name, tie_word_embeddings=True)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    if not keep_embedding:
        del weights["model.embed_tokens.weight"]
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("keep_embedding", [True, False], ids=["both", "lm_head only"])
def test_tied_embeddings_follow_transformers(pretrained, tmp_path, caplog, keep_embedding):
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    folder = _tied_folder(pretrained, tmp_path, "tied", keep_embedding)
    with caplog.at_level(logging.WARNING, logger="flashfsdp"):
        config = TrainConfig.from_argv(["--init-from", folder, "--out", str(tmp_path / "run")]).llama
    assert config.tie_embeddings is not keep_embedding
    warned = "both are kept, untied, as transformers does; set tie_word_embeddings to false" in caplog.text
    assert warned is keep_embedding, caplog.text
    model, _ = build_sharded_model(config, torch.device("cpu"), FP32, seed=None)
    load_pretrained(model, folder, config)
    theirs = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, expected = model(tokens), theirs(tokens).logits
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
