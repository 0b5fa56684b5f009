"""flashfsdp-train's meta-device build: with the same seed, the sharded model that only ever
materialised its shards holds exactly the parameters of an unsharded `Llama.init_weights`."""

import pytest
import torch

from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.train.precision import Precision
from flashfsdp.train.sharding import build_sharded_model
from tests.harness import run_distributed
from tests.training import gather_full_params

# ffn_dim 48 and vocabulary 256 do not split evenly over 3 ranks: pieces of uneven length.
CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)
SEED = 7


def _reference() -> Llama:
    model = Llama(CFG)
    model.init_weights(SEED)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=torch.Generator().manual_seed(0))


def _meta_built(rank: int, world_size: int) -> dict:
    model, vectors = build_sharded_model(CFG, torch.device("cpu"), Precision.from_names("fp32", "fp32").policy, SEED)
    params = gather_full_params(model)  # the values init_weights left (reading them ends the init window)
    with torch.no_grad():
        logits = model(_tokens())
    return {"params": params, "vectors": vectors, "logits": logits,
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "tied": model.output.weight is model.tok_embeddings.weight}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_meta_build_gives_the_unsharded_init(world_size):
    reference = _reference()
    expected = dict(reference.named_parameters())
    with torch.no_grad():
        expected_logits = reference(_tokens())
    for rank, got in enumerate(run_distributed(_meta_built, world_size)):
        assert got["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got["params"][name], value), f"rank {rank}: {name} differs"
        for name, value in reference.named_buffers():
            assert torch.equal(got["buffers"][name], value), f"rank {rank}: buffer {name} differs"
        assert got["tied"]
        assert got["vectors"] == {n for n, p in expected.items() if p.dim() < 2}
        torch.testing.assert_close(got["logits"], expected_logits, rtol=1e-5, atol=1e-5)


def test_precision_rejects_unknown_dtype_names():
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        Precision.from_names("fp8", "fp32")
    with pytest.raises(ValueError, match="all_gather_dtype must be one of"):
        Precision.from_names("bf16", "fp32", "fp8")
