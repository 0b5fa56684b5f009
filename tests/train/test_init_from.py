"""--init-from and --freeze: a transformers Llama saved with save_pretrained, loaded unit by unit
into the sharded model, fine-tuned at W = 2 with half its blocks frozen; export round-trips."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from flashfsdp import get_full_state_dict  # noqa: E402
from flashfsdp.train.config import TrainConfig, UsageError  # noqa: E402
from flashfsdp.train.export import hf_config, main as export_main, to_hf_state_dict  # noqa: E402
from flashfsdp.train.freezing import check_freeze, freeze  # noqa: E402
from flashfsdp.train.hf_config import llama_config  # noqa: E402
from flashfsdp.train.precision import Precision  # noqa: E402
from flashfsdp.train.pretrained import load_pretrained, weight_files  # noqa: E402
from flashfsdp.train.sharding import build_sharded_model  # noqa: E402
from tests.train.trainers import corpus_text, save_hf_llama  # noqa: E402

FP32 = Precision.from_names("fp32", "fp32").policy

LAYERS = 4
FROZEN = "layers.[01].*"  # half the blocks


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny transformers LlamaForCausalLM (untied, grouped-query) with a byte-level tokenizer."""
    return save_hf_llama(tmp_path_factory.mktemp("pretrained") / "tiny-llama", num_hidden_layers=LAYERS)


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    return load_file(os.path.join(folder, "model.safetensors"))


def test_init_from_then_export_round_trips_bit_for_bit(pretrained):
    """Loaded unit by unit into the sharded model, the weights come back out as they went in, and
    the config as transformers wrote it."""
    import transformers  # noqa: PLC0415

    config = llama_config(str(pretrained))
    model, _ = build_sharded_model(config, torch.device("cpu"), FP32, seed=None)
    assert load_pretrained(model, str(pretrained), config) == sum(t.numel() for t in _weights(pretrained).values())
    back = to_hf_state_dict(get_full_state_dict(model), config)
    original = _weights(pretrained)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    theirs = transformers.AutoConfig.from_pretrained(pretrained)
    ours = hf_config(config, transformers)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "vocab_size", "max_position_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "flashfsdp.train", *args], capture_output=True, text=True,
                          timeout=420, env=env)


def test_fine_tune_with_half_the_blocks_frozen_at_two_ranks(pretrained, tmp_path):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    data, out, hf = tmp_path / "corpus.txt", tmp_path / "run", tmp_path / "exported"
    data.write_text(corpus_text())
    done = _train("--init-from", str(pretrained), "--freeze", FROZEN, "--data", str(data), "--out", str(out),
                  "--nproc", "2", "--steps", "20", "--batch-size", "4", "--lr", "3e-3", "--eval-every", "20",
                  "--eval-batches", "2", "--sample-tokens", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainable / frozen" in done.stdout and "0.03M" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["frozen_params"] == sum(
        t.numel() for n, t in _weights(pretrained).items() if n.startswith(("model.layers.0.", "model.layers.1.")))
    val = [json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
           if "val_loss" in line]
    assert val[-1] < val[0]

    assert export_main(["--out", str(out), "--to", str(hf)]) == 0
    before, after = _weights(pretrained), _weights(hf)
    for name, tensor in before.items():
        frozen = name.startswith(("model.layers.0.", "model.layers.1."))
        assert torch.equal(after[name], tensor) == frozen, name
    model = AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_freeze_leaves_frozen_parameters_out_of_the_optimizer(pretrained):
    from flashfsdp.train.trainer import build_optimizer  # noqa: PLC0415

    config = llama_config(str(pretrained))
    model, vectors = build_sharded_model(config, torch.device("cpu"), FP32, seed=0)
    summary = freeze(model, ["*embed*", "model.layers.3.mlp.*"], config)
    assert set(summary.frozen_tensors) == {"tok_embeddings.weight", "layers.3.feed_forward.w1.weight",
                                           "layers.3.feed_forward.w2.weight", "layers.3.feed_forward.w3.weight"}
    assert summary.trainable + summary.frozen == config.num_params()
    optimizer = build_optimizer(model, vectors, 0.1, 1e-3)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in in_optimizer) == p.requires_grad, name


@pytest.mark.parametrize("patterns, message", [
    (["nothing.*"], "--freeze 'nothing.*' matches no parameter"),
    (["*"], "freezes every parameter"),
])
def test_bad_freeze_patterns_are_named(pretrained, patterns, message):
    with pytest.raises(UsageError, match=message.replace("*", r"\*").replace(".", r"\.")):
        check_freeze(patterns, llama_config(str(pretrained)))


def test_bad_init_from_folders_are_one_clear_error(pretrained, tmp_path):
    with pytest.raises(UsageError, match="--init-from .*: no such directory"):
        llama_config(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        llama_config(str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="no model.safetensors or model.safetensors.index.json"):
        weight_files(str(tmp_path / "empty"))
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UsageError, match="model_type 'gpt2'; only transformers' Llama"):
        llama_config(str(tmp_path / "gpt"))
    scaled = json.loads((pretrained / "config.json").read_text())
    scaled["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5}
    (tmp_path / "scaled").mkdir()
    (tmp_path / "scaled" / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(UsageError, match="rotary type 'llama3' is not supported"):
        llama_config(str(tmp_path / "scaled"))
    with pytest.raises(UsageError, match="--layers with --init-from"):
        TrainConfig.from_argv(["--init-from", str(pretrained), "--layers", "2", "--out", str(tmp_path / "o")])


def test_init_from_takes_the_folders_shape_and_tokenizer(pretrained, tmp_path):
    config = TrainConfig.from_argv(["--init-from", str(pretrained), "--seq-len", "8", "--out", str(tmp_path / "o")])
    assert config.data.tokenizer == str(pretrained / "tokenizer.json")
    model = config.llama
    assert (model.n_layers, model.dim, model.kv_heads, model.max_seq_len) == (LAYERS, 32, 2, 8)
    assert not model.tie_embeddings


def _copy_with(pretrained, tmp_path, name: str, **changes) -> str:
    """A copy of the pretrained folder with `changes` made to its config.json."""
    import shutil  # noqa: PLC0415

    folder = tmp_path / name
    shutil.copytree(pretrained, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("changes, message", [
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported (only 'silu')"),
    ({"head_dim": 4}, "head_dim 4 x 4 heads != hidden_size 32"),
    ({"vocab_size": 200}, "the tokenizer's 256 ids do not fit the model's vocab_size 200"),
])
def test_configs_the_model_cannot_compute_exactly_are_refused(pretrained, tmp_path, changes, message):
    folder = _copy_with(pretrained, tmp_path, "changed", **changes)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig.from_argv(["--init-from", folder, "--out", str(tmp_path / "o")])


def test_weights_that_do_not_fit_the_config_are_named(pretrained, tmp_path):
    wider = _copy_with(pretrained, tmp_path, "wider", intermediate_size=96)
    config = llama_config(wider)
    model, _ = build_sharded_model(config, torch.device("cpu"), FP32, seed=None)
    with pytest.raises(UsageError, match=r"layers\.0\.feed_forward\.w1\.weight has shape \(64, 32\), the model of "
                                         r"its config.json has \(96, 32\)"):
        load_pretrained(model, wider, config)
    deeper = _copy_with(pretrained, tmp_path, "deeper", num_hidden_layers=LAYERS + 1)
    config = llama_config(deeper)
    model, _ = build_sharded_model(config, torch.device("cpu"), FP32, seed=None)
    with pytest.raises(UsageError, match=f"the weights have no model.layers.{LAYERS}.input_layernorm.weight"):
        load_pretrained(model, deeper, config)
