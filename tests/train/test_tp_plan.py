"""`flashfsdp.models.tp_plan`: the tensor-parallel Llama computes the unsharded model's loss and
gradients, on 2 TP ranks and on a 2x2 (dp, tp) mesh under torch's FSDP2; its placements are
torchtitan's; a TP degree that does not divide the heads or the hidden width is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.models.tp_plan import check_tp_degree, parallelize_llama_tp
from tests.harness import run_distributed

# Grouped-query attention (2 K/V heads for 4 query heads) and untied or tied output projections.
CONFIG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=8)
BATCH = 4


def _tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.max_seq_len + 1), generator=torch.Generator().manual_seed(3))


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _reference(tie: bool) -> tuple[Llama, torch.Tensor, dict]:
    """The unsharded model, its loss on the whole batch and its gradients."""
    model = Llama(LlamaConfig(**{**CONFIG.__dict__, "tie_embeddings": tie}))
    model.init_weights(0)
    loss = _loss(model, _tokens())
    loss.backward()
    return model, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _placements(model) -> dict:
    return {n: tuple(repr(p) for p in getattr(param, "placements", ())) for n, param in model.named_parameters()}


def _pure_tp(rank: int, world_size: int, tie: bool, sequence_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    reference, ref_loss, ref_grads = _reference(tie)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    parallelize_llama_tp(model, init_device_mesh("cpu", (world_size,)), sequence_parallel=sequence_parallel)
    loss = _loss(model, _tokens())
    loss.backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    errors = {n: float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads}
    wq = model.layers[0].attention.wq.weight
    prompt = _tokens()[:2, :3]  # 3 tokens, then 1 more each step: padded to even lengths under SP
    with torch.no_grad():
        generated = torch.equal(model.generate(prompt, 3, temperature=0), reference.generate(prompt, 3, temperature=0))
        try:
            model(prompt)
            odd = "accepted"
        except ValueError as err:
            odd = str(err)
    return {"generated": generated, "odd": odd,"loss": float(loss.detach()), "ref_loss": float(ref_loss), "errors": errors, "placements": _placements(model),
            "wq_local": tuple(wq.to_local().shape), "tied": model.output.weight is model.tok_embeddings.weight}


@pytest.mark.parametrize("tie, sequence_parallel", [(False, True), (True, True), (False, False)])
def test_two_tp_ranks_give_the_unsharded_loss_and_gradients(tie, sequence_parallel):
    results = run_distributed(_pure_tp, 2, tie, sequence_parallel)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert max(r["errors"].values()) < 1e-5, r["errors"]
        assert r["wq_local"] == (CONFIG.dim // 2, CONFIG.dim)
        assert r["tied"] == tie and r["generated"]
        assert ("is not a multiple of 2" in r["odd"]) if sequence_parallel else r["odd"] == "accepted"
    placements = results[0]["placements"]
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert placements[f"layers.0.{name}.weight"] == ("Shard(dim=0)",), name
    for name in ("attention.wo", "feed_forward.w2"):
        assert placements[f"layers.0.{name}.weight"] == ("Shard(dim=1)",), name
    assert placements["tok_embeddings.weight"] == ("Shard(dim=0)",)
    norm = ("Replicate()",) if sequence_parallel else ()
    assert placements["layers.1.ffn_norm.weight"] == norm and placements["norm.weight"] == norm


def _dp_tp(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    reference, ref_loss, ref_grads = _reference(tie=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):  # built, parallelised and sharded on the meta device, then initialised
        model = Llama(reference.config)
    parallelize_llama_tp(model, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    model.init_weights(0)
    dp = mesh["dp"].get_local_rank()
    rows = _tokens().chunk(2)[dp]  # one TP group: the same rows; the dp ranks: halves of the batch
    loss = _loss(model, rows)
    loss.backward()
    errors = {n: float((p.grad.full_tensor() - ref_grads[n]).abs().max()) for n, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "ref_local": float(_loss(reference, rows)), "errors": errors,
            "placements": _placements(model)}


def test_2x2_dp_tp_under_torch_fsdp2_initialises_and_gives_the_unsharded_gradients():
    results = run_distributed(_dp_tp, 4)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref_local"], rel=1e-5)
        assert max(r["errors"].values()) < 1e-5, r["errors"]
    placements = results[0]["placements"]
    assert placements["layers.0.attention.wo.weight"][1] == "Shard(dim=1)"
    assert placements["layers.0.attention_norm.weight"] == ("Shard(dim=0)", "Replicate()")


@pytest.mark.parametrize("field, shape", [("n_heads", dict(n_heads=3, n_kv_heads=None, dim=48)),
                                          ("n_kv_heads", dict(n_kv_heads=1)),
                                          ("ffn_dim", dict(ffn_dim=91))])
def test_a_tp_degree_that_does_not_divide_the_model_is_refused(field, shape):
    config = LlamaConfig(**{**CONFIG.__dict__, "ffn_dim": 96, **shape})
    with pytest.raises(ValueError, match=f"--tp 2 does not divide the model's {field}"):
        check_tp_degree(config, 2, "--tp")
    with pytest.raises(ValueError, match="--tp must be a positive integer"):
        check_tp_degree(CONFIG, 0, "--tp")
