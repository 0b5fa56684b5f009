"""torchtitan's llama3 debug model, sharded by torchtitan's own ``parallelize_llama`` (its
``apply_fsdp_to_decoder`` calls ``fully_shard`` per block, on the embedding and on [norm, output],
then the root, and disables FSDP's gradient division through ``isinstance(m, FSDPModule)``), trained
with torchtitan's loss (sum over tokens / global token count), its ``clip_grad_norm_`` and its
AdamW container, on CPU/gloo at W = 2.

torchtitan's trainer itself needs an accelerator (its device type falls back to "cuda", its
dataloader and tokenizer need downloaded assets), so this drives the pieces that touch FSDP2,
with three CPU adaptations, each what torchtitan's own tests or a gloo group require:

- ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` (the mesh's device type);
- each layer's attention swapped to ``ScaledDotProductAttention`` as torchtitan's graph-trainer
  tests do (FlexAttention has no backward on CPU);
- ``set_force_sum_reduction_for_comms(True)`` on every unit: under the divide factor 1.0 that
  torchtitan sets, FSDP2 reduce-scatters with PREMUL_SUM, which gloo lacks.

The swap: ``torchtitan.distributed.fsdp.fully_shard`` (the name ``apply_fsdp_to_decoder`` calls)
is replaced by flashfsdp's for the flashfsdp case, inside the rank, and put back after.
"""

from __future__ import annotations

import contextlib
import copy
import importlib

import pytest
import torch

from tests.clients.common import (
    IMPLS,
    W,
    against_torch,
    assert_grads_contract,
    assert_params_contract,
    assert_shards_of,
    assert_sharded_by,
    average_grads,
    local_grads,
    local_params,
    run,
    same_on_all_ranks,
)

pytest.importorskip("torchtitan", reason="torchtitan: pip install -e .[titan]")

SEQ, BATCH, MAX_NORM = 32, 2, 1.0


@contextlib.contextmanager
def _swapped(module_name: str, attr: str, value):
    module = importlib.import_module(module_name)
    old = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, old)


def _debug_model():
    """torchtitan's llama3 "debugmodel" (6 layers, dim 256, vocab 2048) with SDPA attention,
    initialised by its ``init_weights`` on CPU."""
    from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: PLC0415
    from torchtitan.models.llama3 import model_registry  # noqa: PLC0415

    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return spec, model


def _parallelize(spec, model, api):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: PLC0415
    from torchtitan.distributed import ParallelDims  # noqa: PLC0415

    parallelism = ParallelismConfig(data_parallel_shard_degree=W, spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
    with _swapped("torchtitan.distributed.parallel_dims", "device_type", "cpu"), \
            _swapped("torchtitan.distributed.fsdp", "fully_shard", api.fully_shard):
        dims = ParallelDims.from_config(parallelism, W)
        dims.build_mesh()
        model = spec.parallelize_fn(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                    compile_config=CompileConfig(), ac_config=None, dump_folder="")
    for m in model.modules():
        if isinstance(m, torch.distributed.fsdp.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def _titan_training(api, rank, steps=3):
    from torchtitan.components.loss import CrossEntropyLoss  # noqa: PLC0415
    from torchtitan.components.optimizer import default_adamw  # noqa: PLC0415
    from torchtitan.distributed import utils as dist_utils  # noqa: PLC0415

    spec, model = _debug_model()
    ref = copy.deepcopy(model)
    model = _parallelize(spec, model, api)
    assert_sharded_by(model, api)
    assert_params_contract(model, ref, rank)
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=2048).build()
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    ref_opt = default_adamw(lr=8e-4).build(model_parts=[ref])
    gen = torch.Generator().manual_seed(100 + rank)
    positions = torch.arange(SEQ).repeat(BATCH, 1)
    out = {"losses": [], "norms": []}
    for _ in range(steps):
        tokens = torch.randint(2048, (BATCH, SEQ + 1), generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        global_valid_tokens = torch.tensor(float(labels.numel() * W))  # torchtitan: dist_sum_tensor
        losses = []
        for m in (model, ref):
            loss, _ = loss_fn(m(inputs, positions=positions), labels, global_valid_tokens)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        average_grads(ref, divide=False)  # divide factor 1: the sum over ranks of the token-normalised loss
        assert_grads_contract(model, ref, rank)
        assert_shards_of(local_grads(model), ref, rank, "gradients", grads=True)
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True, pp_mesh=None)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, foreach=True)
        # fp32 norms of these gradients (the output layer's: 0.5M entries) are off their float64 value by
        # up to ~1e-4 relative on CPU, differently for the sharded (per-shard norms) and unsharded sums.
        torch.testing.assert_close(norm, ref_norm, rtol=2e-4, atol=0)
        assert same_on_all_ranks(norm)
        for o in (optimizers, ref_opt):
            o.step()
            o.zero_grad()
        out["losses"].append(losses[0])
        out["norms"].append(norm)
    assert_shards_of(local_params(model), ref, rank, f"parameters after {steps} steps")
    out["params"] = local_params(model)
    return out


def _titan_case(rank, world_size, impl):
    against_torch(impl, _titan_training, rank)


@pytest.mark.slow  # ~20 s a case on 2 cores: a 6.2M-parameter model, sharded and unsharded
@pytest.mark.parametrize("impl", IMPLS)
def test_torchtitan_llama3_debug_model(impl):
    """torchtitan's ``parallelize_llama`` on its llama3 debug model: every parameter a
    ``(Shard(0),)`` DTensor; three steps with its token-normalised loss, its ``clip_grad_norm_``
    (a DTensor norm, ``full_tensor()``'d) and its AdamW container give the unsharded model's
    losses, gradients (summed over ranks: torchtitan sets the divide factor to 1 through its
    FSDPModule gate), norms and parameters, and, for flashfsdp, torch's FSDP2's."""
    run(_titan_case, impl)
