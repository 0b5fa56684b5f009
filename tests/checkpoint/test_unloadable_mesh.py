"""flashfsdp.checkpoint.load into a model whose sharding DCP cannot fill, at W = 2: a model
fully_shard'ed on a device mesh whose order of ranks is not its process group's ([1, 0]) holds on
each rank a local chunk other than the one its placements describe, so DCP would fail partway
through its read ("mismatch sizes"), the model half loaded. The load says so before anything is
read, on both ranks, naming the parameter and the mesh, and the model is unchanged."""

from __future__ import annotations

import os

import torch

import flashfsdp
from flashfsdp import checkpoint
from tests.checkpoint.common import assert_values, local_values, sharded_mlp
from tests.harness import run_distributed
from tests.models import make_mlp

TIMEOUT_S = 180  # generous for process start-up on a busy machine; a hang never ends


def _load_into_reversed_mesh(rank: int, world_size: int, out: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    model = sharded_mlp(seed=1)
    path = checkpoint.save(os.path.join(out, "ckpt"), model, torch.optim.AdamW(model.parameters()), step=1)
    reversed_model = make_mlp(seed=2)
    mesh = DeviceMesh("cpu", [1, 0])
    for unit in reversed_model.units():
        flashfsdp.fully_shard(unit, mesh=mesh)
    before = local_values(reversed_model)
    opt = torch.optim.AdamW(reversed_model.parameters())
    try:
        checkpoint.load(path, reversed_model, opt)
    except Exception as exc:  # noqa: BLE001 - the test checks what every rank raised
        error = (type(exc).__name__, str(exc))
    else:
        error = None
    assert_values(reversed_model, before)  # nothing was read into it
    return {"error": error, "optimizer_state": len(opt.state)}


def test_a_mesh_dcp_cannot_fill_is_named_before_anything_is_read(tmp_path):
    results = run_distributed(_load_into_reversed_mesh, 2, str(tmp_path), timeout=TIMEOUT_S)
    for result in results:
        assert result["error"] is not None, "the load raised nothing"
        kind, message = result["error"]
        assert kind == "ValueError", message
        assert message.startswith("load: parameter 'inp.weight': this rank holds a local chunk of shape "), message
        assert "on the device mesh of ranks [1, 0] give it a chunk of shape " in message, message
        assert "DCP cannot reshard checkpoint" in message and "init_device_mesh" in message, message
        assert result["optimizer_state"] == 0
