"""`flashfsdp-train export`: a run's newest checkpoint as a transformers LlamaForCausalLM folder whose
fp32 logits are the job's model's bit for bit, every weight written as it is, with a tokenizer that
gives the job's ids."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from flashfsdp import get_full_state_dict  # noqa: E402
from flashfsdp.models import Llama, LlamaConfig  # noqa: E402
from flashfsdp.train.checkpoints import save_checkpoint  # noqa: E402
from flashfsdp.train.config import TrainConfig  # noqa: E402
from flashfsdp.train.export import hf_config, main, to_hf_state_dict  # noqa: E402
from flashfsdp.train.hf_tokenizer import run_tokenizer  # noqa: E402
from flashfsdp.train.precision import Precision  # noqa: E402
from flashfsdp.train.sharding import build_sharded_model  # noqa: E402
from flashfsdp.train.tokenizer import ByteTokenizer, FileTokenizer  # noqa: E402

FP32 = Precision.from_names("fp32", "fp32").policy

EXACT = dict(rtol=0, atol=0)


def _tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def _job_run(out) -> torch.nn.Module:
    """A run directory as the job leaves it (run.json; the job's sharded model after one AdamW step,
    saved by the job's checkpoint code at steps 1 and 2); returns the model."""
    config = TrainConfig.from_argv(["--preset", "tiny", "--layers", "2", "--seq-len", "32", "--out", str(out)])
    config.save()
    model, _ = build_sharded_model(config.llama, torch.device("cpu"), FP32, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):
        tokens = _tokens(256, 33)
        torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(str(out), model, optimizer, step, {}, keep=2, rank=0)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the job's model, the export folder, what export printed)."""
    tmp = tmp_path_factory.mktemp("export")
    job = _job_run(tmp / "run")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "model-00001-of-00002.safetensors").write_text("an earlier save's shard")
    return job, tmp / "hf", main(["--out", str(tmp / "run"), "--to", str(tmp / "hf")])


def test_export_loads_in_transformers_with_the_jobs_logits(exported):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    job, folder, code = exported
    assert code == 0
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.lm_head.weight is hf.model.embed_tokens.weight
    tokens = _tokens(256, 32)
    with torch.no_grad():
        want, got = job(tokens), hf(tokens).logits
        torch.testing.assert_close(got, want, **EXACT)
        # the comparison can fail: one weight moved by an ulp shows in the logits
        q_proj = hf.model.layers[0].self_attn.q_proj.weight
        q_proj[0, 0] = torch.nextafter(q_proj[0, 0], torch.tensor(1.0))
        assert not torch.equal(hf(tokens).logits, want)


def test_export_writes_every_weight_exactly(exported):
    from safetensors.torch import load_file  # noqa: PLC0415

    job, folder, _ = exported
    written, full = load_file(folder / "model.safetensors"), get_full_state_dict(job)
    for i in range(job.config.n_layers):
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj")):
            assert torch.equal(written[f"model.layers.{i}.self_attn.{theirs}.weight"],
                               full[f"layers.{i}.attention.{ours}.weight"])
    assert torch.equal(written["model.embed_tokens.weight"], full["tok_embeddings.weight"])
    assert torch.equal(written["model.layers.1.mlp.up_proj.weight"], full["layers.1.feed_forward.w3.weight"])
    assert len(written) == 2 + 9 * job.config.n_layers  # tied: no lm_head


def test_the_exported_tokenizer_gives_the_jobs_ids(exported):
    """A byte-level run: AutoTokenizer gives each UTF-8 byte's value, and decodes back."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(exported[1])
    text = "def é(x):\n\treturn  x 🙂"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == ByteTokenizer().encode(text) and tokenizer.decode(ids) == text and len(tokenizer) == 256


def test_a_tokenizer_json_is_exported_as_it_is(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    trained = Tokenizer(models.BPE(unk_token="[UNK]"))
    trained.pre_tokenizer = pre_tokenizers.Whitespace()
    trained.train_from_iterator(["def f(x): return x", "class A: pass"] * 20,
                                trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    trained.save(str(tmp_path / "tokenizer.json"))
    run_tokenizer(str(tmp_path / "tokenizer.json"), transformers).save_pretrained(tmp_path / "hf")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def g(y): return y"
    want = FileTokenizer(str(tmp_path / "tokenizer.json")).encode(text)
    assert exported(text, add_special_tokens=False).input_ids == want


def test_grouped_query_untied_llama_converts():
    """Grouped key/value heads and an untied output (lm_head): the same logits bit for bit."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    config = LlamaConfig(vocab_size=50, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                         rope_theta=500000.0, tie_embeddings=False)
    model = Llama(config)
    model.init_weights(3)
    hf = LlamaForCausalLM(hf_config(config, transformers)).eval()
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), config), strict=True)
    tokens = _tokens(50, 16)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), **EXACT)


def test_export_without_a_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    TrainConfig.from_argv(["--preset", "tiny", "--out", str(tmp_path / "run")]).save()
    assert main(["--out", str(tmp_path / "run"), "--to", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no complete checkpoint yet" in err[0] and "--out" in err[0]
    assert not (tmp_path / "hf").exists()
    assert main(["--out", str(tmp_path / "nowhere"), "--to", str(tmp_path / "hf")]) == 2
    assert "not a flashfsdp-train run directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["--out", str(tmp_path / "run"), "--to", str(tmp_path / "file")]) == 2
    assert "is a file; pass a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path / "run")])
    assert exited.value.code == 2


def test_export_of_an_earlier_step(exported, capsys):
    """--step 1 exports the first of the two checkpoints: other weights than the newest's."""
    from safetensors.torch import load_file  # noqa: PLC0415

    run, first = exported[1].parent / "run", exported[1].parent / "step1"
    assert main(["--out", str(run), "--to", str(first), "--step", "1"]) == 0
    assert "step 1 of" in capsys.readouterr().out
    newest, earlier = load_file(exported[1] / "model.safetensors"), load_file(first / "model.safetensors")
    assert newest.keys() == earlier.keys()
    assert not torch.equal(newest["model.norm.weight"], earlier["model.norm.weight"])
    assert main(["--out", str(run), "--to", str(first), "--step", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step 7: the run has no checkpoint of that step (the newest is step_2)" in err[0]


def test_export_without_the_libraries_names_the_extra(exported, capsys, monkeypatch):
    run = exported[1].parent / "run"
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["--out", str(run), "--to", str(exported[1].parent / "elsewhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'flashfsdp[hf]'" in err[0]
