"""Hugging Face models sharded with flashfsdp: the stock DSD full state dict against FSDP2's, and
``flashfsdp.save_pretrained`` reloaded with ``from_pretrained`` (exact fp32 logits) within one unit
of gathered memory.

One W = 2 run does the multi-rank work; the reloads and the bad-input cases run in the test process.
"""

from __future__ import annotations

import json
import os
import sys
import weakref

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import flashfsdp  # noqa: E402
from flashfsdp.bindings.state_dict import hf_save  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

TOKENS = (torch.arange(14).reshape(2, 7) * 5) % 64


def tiny_llama(seed: int = 0, layers: int = 2):
    """A tied-embedding LlamaForCausalLM with grouped-query attention, a few thousand parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0):
    """A GPT2LMHeadModel (Conv1D weights, biases, tied head), dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def _blocks(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def shard(model, fully_shard=flashfsdp.fully_shard):
    """One unit per decoder block, and the root."""
    for block in _blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    return shard(model, fully_shard)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _dsd(rank: int) -> dict:
    """The stock full getters on FSDP2 and on flashfsdp (same weights), and the stock full setter."""
    full, full_cpu = StateDictOptions(full_state_dict=True), StateDictOptions(full_state_dict=True, cpu_offload=True)
    fsdp2, flash = _fsdp2(tiny_llama()), shard(tiny_llama())
    res = {f"{name}_{kind}": get_model_state_dict(model, options=options)
           for name, model in (("fsdp2", fsdp2), ("flash", flash))
           for kind, options in (("full", full), ("cpu", full_cpu))}
    other = shard(tiny_llama(seed=1))
    # Every rank passes the full dict; DSD replaces its entries by the DTensors it distributes
    # them into (on an FSDP2 model as on this one): a copy keeps FSDP2's result for the checks.
    set_model_state_dict(other, dict(res["fsdp2_full"]), options=full)
    res["set_then_get"] = get_model_state_dict(other, options=full)
    return res


class LiveGathered:
    """Wraps ``hf_save.full_unit_params`` to track the bytes of the gathered tensors alive at once."""

    def __init__(self, gather):
        self.gather, self.alive, self.peak = gather, [], 0

    def live(self) -> int:
        self.alive = [(ref, n) for ref, n in self.alive if ref() is not None]
        return sum(n for _, n in self.alive)

    def __call__(self, *args, **kwargs):
        before = self.live()
        out = self.gather(*args, **kwargs)
        self.alive += [(weakref.ref(t), t.numel() * t.element_size()) for t in out.values()]
        self.peak = max(self.peak, before + sum(t.numel() * t.element_size() for t in out.values()))
        return out


def _unit_bytes(model) -> list[int]:
    """Full bytes of each unit's parameters (a tied one once)."""
    return [sum(sum(g.layout.numels) * g.sharded_flat.element_size() for g in state.unit.groups)
            for state in {id(m._flashfsdp_state): m._flashfsdp_state
                          for m in model.modules() if "_flashfsdp_state" in m.__dict__}.values()]


def _method_save(model, path: str) -> str | None:
    """transformers' own ``model.save_pretrained(path)``: the class of the error it raised, or None."""
    try:
        model.save_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - what it raised is the result
        return type(exc).__name__
    return None


def _save(rank: int, out: str) -> dict:
    """flashfsdp.save_pretrained of a 6-block Llama (one file per unit, gathered bytes tracked) and a
    GPT-2 (one file), transformers' own save_pretrained method of the GPT-2 sharded by flashfsdp and
    by FSDP2 (every rank calls it), with the sharded models' logits."""
    llama, gpt2 = shard(tiny_llama(layers=6)), shard(tiny_gpt2())
    tracker = LiveGathered(hf_save.full_unit_params)
    hf_save.full_unit_params = tracker
    try:
        llama_files = hf_save.save_pretrained(llama, os.path.join(out, "llama"))
    finally:
        hf_save.full_unit_params = tracker.gather
    gpt2_files = hf_save.save_pretrained(gpt2, os.path.join(out, "gpt2"), max_shard_size="1GB")
    method = {"flashfsdp": _method_save(gpt2, os.path.join(out, "gpt2_method")),
              "fsdp2": _method_save(_fsdp2(tiny_gpt2()), os.path.join(out, "gpt2_method_fsdp2"))}
    open(os.path.join(out, "a_file"), "w").close()
    try:  # rank 0 cannot create the folder: every rank raises (none waits in an all-gather)
        hf_save.save_pretrained(gpt2, os.path.join(out, "a_file", "gpt2"))
        failed = None
    except NotADirectoryError as exc:
        failed = str(exc)
    return {"llama_files": llama_files, "gpt2_files": gpt2_files, "failed": failed, "peak": tracker.peak,
            "method": method,
            "units": _unit_bytes(llama), "llama": _logits(llama), "gpt2": _logits(gpt2)}


def _ranks(rank: int, world_size: int, out: str) -> dict:
    return {**_dsd(rank), **_save(rank, out)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    return out, run_distributed(_ranks, 2, out)


def _assert_identical(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert type(got[key]) is torch.Tensor and got[key].device == value.device, key
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_stock_full_state_dict_is_fsdp2s(results):
    """get_model_state_dict(full_state_dict=True[, cpu_offload=True]) gives exactly FSDP2's dict."""
    _, (r0, r1) = results
    want = tiny_llama().state_dict()
    for r in (r0, r1):
        _assert_identical(r["flash_full"], r["fsdp2_full"])
    _assert_identical(r0["flash_cpu"], r0["fsdp2_cpu"])
    assert r1["flash_cpu"] == r1["fsdp2_cpu"] == {}  # cpu_offload: rank 0 keeps it, as with FSDP2
    assert list(r0["flash_cpu"]) == list(want)
    for key, value in want.items():
        assert torch.equal(r0["flash_cpu"][key], value), key


def test_stock_full_set_model_state_dict(results):
    _, (r0, r1) = results
    for r in (r0, r1):
        _assert_identical(r["set_then_get"], r["fsdp2_full"])


def test_save_pretrained_reloads_with_the_same_logits(results):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    out, (r0, r1) = results
    assert r0["llama_files"] == [f"model-0000{i}-of-00007.safetensors" for i in range(1, 8)]
    assert r0["gpt2_files"] == ["model.safetensors"]
    assert sorted(os.listdir(os.path.join(out, "gpt2"))) == ["config.json", "generation_config.json",
                                                             "model.safetensors"]
    index = json.load(open(os.path.join(out, "llama", hf_save.INDEX_FILE)))
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    for folder, name in (("llama", "llama"), ("gpt2", "gpt2")):
        reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, folder)).eval()
        assert type(reloaded).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[name]
        logits = _logits(reloaded)
        assert logits.dtype == torch.float32
        assert (logits - r0[name]).abs().max().item() == 0.0, folder
        assert torch.equal(r0[name], r1[name])


def test_the_save_pretrained_method_fails_as_on_fsdp2(results):
    """transformers' own method gets model.state_dict()'s DTensors and raises, on a model sharded by
    hand with flashfsdp as with FSDP2, leaving no weights to load: flashfsdp.save_pretrained is the way."""
    out, (r0, _) = results
    # rank 0 raises with both (FSDP2's rank 1 returns: only rank 0 writes there; flashfsdp's raises
    # before writing, in transformers' tied-weight check of the DTensors, on every rank)
    assert r0["method"] == {"flashfsdp": "RuntimeError", "fsdp2": "RuntimeError"}
    for folder in ("gpt2_method", "gpt2_method_fsdp2"):
        path = os.path.join(out, folder)
        assert not os.path.isdir(path) or not any(n.endswith(".safetensors") for n in os.listdir(path)), folder


def test_save_pretrained_failing_on_rank0_raises_on_every_rank(results):
    _, (r0, r1) = results
    assert "a_file" in r0["failed"] and r1["failed"].endswith("(rank 0)")


def test_save_pretrained_holds_one_unit_at_a_time(results):
    """Rank 0's gathered tensors alive at once never exceed the largest unit; rank 1 keeps none."""
    _, (r0, r1) = results
    assert 0 < r0["peak"] <= max(r0["units"])  # a unit's parameters, its padding aside
    assert r0["peak"] * 3 < sum(r0["units"])
    assert r1["peak"] == 0


def test_save_pretrained_at_w1_and_rewrites_the_folder(tmp_path):
    """No process group: one process saves; a second save with one file removes the first's shards."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = shard(tiny_llama())
    hf_save.save_pretrained(model, tmp_path)
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) == 3
    hf_save.save_pretrained(model, str(tmp_path), max_shard_size=10**9)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(_logits(reloaded), _logits(model))


def test_save_pretrained_writes_the_master_dtype_under_bf16_compute_and_cpu_offload(tmp_path):
    from safetensors.torch import load_file  # noqa: PLC0415

    want = tiny_llama().state_dict()
    model = tiny_llama()
    policy = dict(mp_policy=flashfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                  offload_policy=flashfsdp.CPUOffloadPolicy())
    for block in model.model.layers:
        flashfsdp.fully_shard(block, **policy)
    flashfsdp.fully_shard(model, **policy)
    _logits(model)  # a bf16 forward: the unsharded parameters are bf16 copies
    (name,) = hf_save.save_pretrained(model, tmp_path, max_shard_size="1GB")
    written = load_file(tmp_path / name)
    assert sorted(written) == sorted(k for k in want if k != "lm_head.weight")
    for key, value in written.items():
        assert value.dtype == torch.float32 and torch.equal(value, want[key]), key
    assert json.load(open(tmp_path / "config.json"))["dtype"] == "float32"


def test_save_pretrained_of_an_fsdp1_wrapper_says_what_to_call(tmp_path):
    """FSDP1's state dict names drop the wrappers' segments; its own full state dict serves the method."""
    import functools  # noqa: PLC0415

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: PLC0415

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    wrapped = flashfsdp.FullyShardedDataParallel(tiny_llama(), auto_wrap_policy=policy)
    with pytest.raises(TypeError, match=r"FSDP1 FullyShardedDataParallel wrapper.*model.module.save_pretrained"):
        hf_save.save_pretrained(wrapped, tmp_path)
    wrapped.module.save_pretrained(tmp_path)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval()), _logits(wrapped))


def test_save_pretrained_refuses_an_all_gather_extension_parameter(tmp_path):
    """A tensor-subclass weight with FSDP2's all-gather hooks (kept outside the flat shard; no
    safetensors form) is refused before anything is gathered or written, naming it."""
    from tests.fsdp2_suite.test_extensions import _patched_two_tensor, _pre_v2  # noqa: PLC0415
    from torch.testing._internal.two_tensor import TwoTensor  # noqa: PLC0415

    with _patched_two_tensor(_pre_v2):
        model = tiny_llama()
        proj = model.model.layers[0].mlp.up_proj
        proj.weight = torch.nn.Parameter(TwoTensor(proj.weight.detach().clone(), proj.weight.detach().clone()))
        model = shard(model)
        with pytest.raises(NotImplementedError, match=r"save_pretrained.*'model\.layers\.0\.mlp\.up_proj\.weight'.*TwoTensor"):
            hf_save.save_pretrained(model, tmp_path)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]


def test_save_pretrained_writes_buffers_outside_units(tmp_path):
    """A persistent buffer (no unit holds buffers) is written as it is, in a file of its own."""
    from safetensors.torch import load_file  # noqa: PLC0415

    model = tiny_llama()
    model.model.norm.register_buffer("calibration", torch.arange(4.0))
    files = hf_save.save_pretrained(shard(model), tmp_path)
    written = load_file(tmp_path / files[-1])
    assert list(written) == ["model.norm.calibration"]
    assert torch.equal(written["model.norm.calibration"], torch.arange(4.0))


def test_save_pretrained_bad_input(tmp_path):
    sharded = shard(tiny_llama())
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        hf_save.save_pretrained(torch.nn.Linear(2, 2), tmp_path)
    with pytest.raises(ValueError, match="no fully_shard'ed module"):
        hf_save.save_pretrained(tiny_llama(), tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        hf_save.save_pretrained(sharded, tmp_path / "file")
    with pytest.raises(TypeError, match="save_directory must be a path"):
        hf_save.save_pretrained(sharded, 3)
    with pytest.raises(TypeError, match="max_shard_size must be None"):
        hf_save.save_pretrained(sharded, tmp_path, max_shard_size=0)
    with pytest.raises(ValueError, match="max_shard_size 'big' is not a size"):
        hf_save.save_pretrained(sharded, tmp_path, max_shard_size="big")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_save_pretrained_without_the_libraries_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"needs transformers >= 5 and safetensors .*pip install 'flashfsdp\[hf\]'"):
        hf_save.save_pretrained(shard(tiny_llama()), tmp_path)
