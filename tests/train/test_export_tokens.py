"""`flashfsdp-train export` keeps the special tokens: a run fine-tuned from a transformers Llama whose
tokenizer has `<s>` / `</s>` exports a folder whose config.json, tokenizer_config.json and
generation_config.json name them, and transformers' `generate` stops at the end-of-sequence token."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from flashfsdp.train.config import TrainConfig  # noqa: E402
from flashfsdp.train.export import main as export_main  # noqa: E402
from flashfsdp.train.hf_tokenizer import byte_tokenizer  # noqa: E402
from tests.train.trainers import finished_run, save_hf_llama  # noqa: E402

BOS, EOS = 256, 257  # after the 256 bytes


def _tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def _says_eos(model) -> None:
    """Weights whose next token is always `</s>`: no block writes to the residual stream, every
    embedding's first feature is 1, the final norm keeps that feature only, and only `</s>`'s
    output row reads it."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOS, 0] = 10.0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The export folder of a run started from a transformers Llama with `<s>` and `</s>`."""
    import transformers  # noqa: PLC0415

    tmp = tmp_path_factory.mktemp("tokens")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token="<s>", eos_token="</s>")
    source = save_hf_llama(tmp / "llama", tokenizer, _says_eos, vocab_size=258, max_position_embeddings=32,
                           bos_token_id=BOS, eos_token_id=EOS)
    finished_run(TrainConfig.from_argv(["--init-from", str(source), "--out", str(tmp / "run"), "--steps", "1"]))
    assert export_main(["--out", str(tmp / "run"), "--to", str(tmp / "hf")]) == 0
    return tmp / "hf"


def test_the_files_name_the_special_tokens(exported):
    folder = exported
    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS, EOS)
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    assert (tokenizer["bos_token"], tokenizer["eos_token"]) == ("<s>", "</s>")
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS, EOS)


def test_generate_stops_at_the_end_of_sequence(exported):
    import transformers  # noqa: PLC0415

    folder = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("def f", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert out[0, -1].item() == EOS and out.shape[1] == prompt.shape[1] + 1, out  # stopped, not 10 tokens
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS, EOS)
    assert tokenizer.decode(out[0], skip_special_tokens=True) == "def f"


def test_a_tokenizer_config_alone_gives_the_ids(tmp_path):
    """A --tokenizer run (no --init-from): the ids come from the tokenizer_config.json beside the
    tokenizer.json, and make the generation config; a byte-level run has none."""
    import transformers  # noqa: PLC0415

    from flashfsdp.train.hf_special import special_tokens  # noqa: PLC0415

    transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), eos_token="</s>").save_pretrained(tmp_path)
    special = special_tokens(str(tmp_path / "tokenizer.json"), None)
    assert special.tokens == {"eos_token": "</s>"} and special.ids == {"eos_token_id": EOS}
    assert special.generation == {"eos_token_id": EOS}
    none = special_tokens(None, None)
    assert (none.tokens, none.ids, none.generation) == ({}, {}, None)
