"""Lightning Fabric's ``ModelParallelStrategy`` with a ``parallelize_fn`` that calls ``fully_shard``
(the import swapped), on CPU with gloo at W = 2, inside ranks the suite spawns (``LOCAL_RANK`` set:
Fabric takes the processes as created externally and the process group as already initialised).

Fabric relies on FSDP2's types: its checkpointing finds the model by its DTensor parameters
(``_has_dtensor_modules``) and goes through ``torch.distributed.checkpoint``; ``no_backward_sync``
calls ``set_requires_gradient_sync`` on every module that passes
``isinstance(m, torch.distributed._composable.fsdp.FSDPModule)``.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.clients.common import (
    IMPLS,
    against_torch,
    assert_close_tree,
    assert_grads_contract,
    assert_params_contract,
    assert_shards_of,
    assert_sharded_by,
    average_grads,
    batches,
    describe,
    local_grads,
    local_params,
    replicate,
    run,
    tiny_gpt,
)

pytest.importorskip("lightning", reason="lightning: pip install -e .[clients]")


def _fabric(api):
    """A Fabric whose strategy shards each block and the root over the mesh's data-parallel dim."""
    from lightning.fabric import Fabric  # noqa: PLC0415
    from lightning.fabric.strategies import ModelParallelStrategy  # noqa: PLC0415

    def parallelize(model, device_mesh):
        mesh = device_mesh["data_parallel"]
        for block in model.h:
            api.fully_shard(block, mesh=mesh)
        api.fully_shard(model, mesh=mesh)
        return model

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric, seed):
    model = tiny_gpt(seed)
    ref = replicate(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer, ref


def _accumulating_steps(fabric, model, optimizer, ref, ref_opt, rank, steps, seed):
    """``steps`` optimizer steps of two micro-batches each, the first under ``no_backward_sync``."""
    losses = []
    for step in range(steps):
        micro = batches(model.module, rank + 10 * seed, 2)
        for i, (idx, targets) in enumerate(micro):
            last = i == len(micro) - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = model(idx, targets)
                fabric.backward(loss)
            ref(idx, targets).backward()
            if not last:  # no reduce-scatter: the sharded parameters have no gradient yet
                assert all(p.grad is None for p in model.parameters()), \
                    "a gradient reached the sharded parameters inside no_backward_sync"
        average_grads(ref)
        assert_grads_contract(model.module, ref, rank)
        assert_shards_of(local_grads(model.module), ref, rank, f"step {step}: accumulated gradients", grads=True)
        for o in (optimizer, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.detach())
    assert_shards_of(local_params(model.module), ref, rank, f"parameters after {steps} steps")
    return losses


def _optimizer_state(model, optimizer) -> dict:
    return {name: {k: (describe(v), v.to_local().clone() if hasattr(v, "to_local") else v.clone())
                   for k, v in optimizer.state[p].items()}
            for name, p in model.module.named_parameters()}


def _fabric_training(api, rank, ckpt_dir):
    fabric = _fabric(api)
    model, optimizer, ref = _setup(fabric, 0)
    assert_sharded_by(model.module, api)
    assert_params_contract(model.module, ref, rank)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = _accumulating_steps(fabric, model, optimizer, ref, ref_opt, rank, 2, 0)

    path = os.path.join(ckpt_dir, api.__name__)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    saved_params, saved_opt = local_params(model.module), _optimizer_state(model, optimizer)

    # A model set up from another seed, then loaded: the saved parameters and optimizer state.
    loaded, loaded_opt, _ = _setup(fabric, 1)
    state = {"model": loaded, "optimizer": loaded_opt, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == 2 and remainder == {}, (state["step"], remainder)
    assert_params_contract(loaded.module, ref, rank)
    assert_close_tree(local_params(loaded.module), saved_params, "parameters after fabric.load", rtol=0, atol=0)
    assert_close_tree(_optimizer_state(loaded, loaded_opt), saved_opt, "optimizer state after fabric.load",
                      rtol=0, atol=0)
    # Training on from the loaded state is training on from the saved one.
    _accumulating_steps(fabric, loaded, loaded_opt, ref, ref_opt, rank, 1, 2)
    return {"losses": losses, "params": saved_params, "optimizer": saved_opt,
            "resumed": local_params(loaded.module)}


def _fabric_case(rank, world_size, impl, ckpt_dir):
    against_torch(impl, _fabric_training, rank, ckpt_dir)


@pytest.mark.parametrize("impl", IMPLS)
def test_fabric_model_parallel_strategy(impl, tmp_path):
    """Fabric's ``ModelParallelStrategy``: ``setup_module`` runs the ``parallelize_fn`` (DTensor
    parameters on the data-parallel mesh), ``no_backward_sync`` on the first of two micro-batches
    keeps gradients off the sharded parameters (no reduce-scatter) and the accumulated gradients
    are the unsharded model's; ``fabric.save`` (a distributed checkpoint of model, optimizer and
    metadata) and ``fabric.load`` into a model set up from another seed give back the exact
    parameters and AdamW state, and training resumes as the unsharded model does."""
    run(_fabric_case, impl, str(tmp_path))
