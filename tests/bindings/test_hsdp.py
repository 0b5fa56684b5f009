"""HSDP: fully_shard over a 2-D DeviceMesh (replicate, shard) of 2 x 2 gloo ranks.

One W = 4 run (spawning four ranks is the expensive part on a small machine) checks, against
the replicated reference (one process, the whole global batch) and against torch's own
``fully_shard`` on the same mesh and seeds: fp32 training parity, bf16 mixed precision, gradient
accumulation (``set_requires_gradient_sync``) with CPU offload, ``set_requires_all_reduce``
(reduce-scatter only, then the all-reduce), the bytes every group carries in one step against
their analytic volume, sharded checkpoints (DCP through ``flashfsdp.checkpoint`` and the stock
``get/set_model_state_dict``) saved once per replica set and loaded onto 2-D and 1-D meshes, and
bad meshes. The test functions then compare what each rank returned.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import flashfsdp
from flashfsdp.runtime.process_group import ProcessGroupCommunicator
from tests.harness import run_distributed
from tests.models import loss_fn, make_batch, make_mlp
from tests.training import (gather_full_optimizer_state, gather_full_params, local_rows, train_flashfsdp,
                            train_reference, train_torch_fsdp2, units_of)

W, R, S = 4, 2, 2  # world size, replicas, shard group size
FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)


def _mesh(names=("replicate", "shard")):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    return init_device_mesh("cpu", (R, S), mesh_dim_names=names)


def _sharded_mlp(mesh, seed: int = 0, **kwargs):
    model = make_mlp(seed)
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit, mesh=mesh, **kwargs)
    return model


# ---------------------------------------------------------------------------------- in the ranks
def _training(rank, mesh) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy  # noqa: PLC0415

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = flashfsdp.CPUOffloadPolicy(pin_memory=False)
    return {
        "fp32": train_flashfsdp("mlp", rank, W, steps=2, shard_kwargs={"mesh": mesh}),
        "torch_fp32": train_torch_fsdp2("mlp", rank, W, steps=2, shard_kwargs={"mesh": mesh}),
        "bf16": train_flashfsdp("mlp", rank, W, steps=2, mp_policy=flashfsdp.MixedPrecisionPolicy(**bf16),
                                shard_kwargs={"mesh": mesh}),
        "torch_bf16": train_torch_fsdp2("mlp", rank, W, steps=2, mp_policy=TorchPolicy(**bf16),
                                        shard_kwargs={"mesh": mesh}),
        "accum_offload": train_flashfsdp("mlp", rank, W, steps=1, grad_accum=2,
                                         shard_kwargs={"mesh": mesh, "offload_policy": offload}),
    }


def _counted(records: list):
    """Wrap ProcessGroupCommunicator's collectives to record (kind, group ranks, bytes); returns
    the restore function."""
    saved = {}
    for kind, attr, arg in (("all_gather", "all_gather_into_tensor", 0), ("reduce_scatter", "reduce_scatter_tensor", 1),
                            ("all_reduce", "all_reduce", 0)):
        orig = saved[attr] = getattr(ProcessGroupCommunicator, attr)

        def counted(self, *args, _orig=orig, _kind=kind, _arg=arg, **kwargs):
            t = args[_arg]  # the all-gather's output, the reduce-scatter's input, the all-reduced tensor
            records.append((_kind, tuple(dist.get_process_group_ranks(self.group)), t.numel() * t.element_size()))
            return _orig(self, *args, **kwargs)

        setattr(ProcessGroupCommunicator, attr, counted)
    return lambda: [setattr(ProcessGroupCommunicator, a, f) for a, f in saved.items()]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _analytic_unit_bytes(model) -> list[tuple[int, int]]:
    """Per unit (innermost first), the fp32 bytes of (its all-gather output, one rank's segment of
    its reduce-scatter). A rank's shard holds every parameter's FSDP2 dim-0 chunk (ceil(d0 / S)
    rows, padded) at offsets aligned to 16 bytes, its size a multiple of 16 bytes; the all-gather
    lands S shards. A reduce-scatter segment is the shard and one flag per parameter (which
    gradients are None), padded to 16 bytes."""
    sizes, claimed = [], set()
    for unit in units_of("mlp", model):
        used, count = 0, 0
        for p in unit.parameters():
            if id(p) not in claimed:
                claimed.add(id(p))
                used = _round_up(used, 4) + -(-p.shape[0] // S) * p[0].numel()
                count += 1
        shard = _round_up(used, 4)
        sizes.append((S * shard * 4, (shard + _round_up(count, 4)) * 4))
    return sizes


def _bytes_per_step(rank, mesh) -> dict:
    """The second forward + backward (the first one's lazy init may communicate too) with explicit
    resharding and backward all-gather elision off: every unit all-gathers twice (with elision
    the first unit, whose input needs no gradient, would skip its backward all-gather: the
    elision tests count that)."""
    expected = _analytic_unit_bytes(make_mlp())
    model = _sharded_mlp(mesh, reshard_after_forward=True)
    model.set_backward_all_gather_elision(False)
    x, y = make_batch("mlp", 0, 2 * W)
    x, y = local_rows(x, rank, W), local_rows(y, rank, W)
    loss_fn("mlp", model(x), y).backward()
    records: list = []
    restore = _counted(records)
    try:
        loss_fn("mlp", model(x), y).backward()
    finally:
        restore()
    return {"records": records, "expected_unit_bytes": expected}


def _all_reduce_switch(rank, mesh) -> dict:
    """Two micro-batches: the first with set_requires_all_reduce(False) (reduce-scatter only, no
    gradient yet), the second with the all-reduce; flashfsdp and torch's fully_shard."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: PLC0415

    x, y = make_batch("mlp", 0, 2 * W)
    x, y = local_rows(x, rank, W), local_rows(y, rank, W)
    out = {}
    for impl, shard in (("flashfsdp", flashfsdp.fully_shard), ("torch", torch_fully_shard)):
        model = make_mlp()
        for unit in units_of("mlp", model):
            shard(unit, mesh=mesh)
        records: list = []
        restore = _counted(records) if impl == "flashfsdp" else (lambda: None)
        model.set_requires_all_reduce(False)
        loss_fn("mlp", model(x[:1]), y[:1]).div(2).backward()
        first = {"kinds": sorted({r[0] for r in records}), "grads_none": all(p.grad is None for p in model.parameters())}
        model.set_requires_all_reduce(True)
        loss_fn("mlp", model(x[1:]), y[1:]).div(2).backward()
        restore()
        if impl == "flashfsdp":
            out["first"] = first
            out["placements"] = {tuple(p.grad.placements) for p in model.parameters()}
        out[impl] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return out


def _train_one_step(model, rank) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_batch("mlp", 0, 2 * W)
    loss_fn("mlp", model(local_rows(x, rank, W)), local_rows(y, rank, W)).backward()
    opt.step()
    return opt


def _checkpoints(rank, mesh, tmp) -> dict:
    """Save an HSDP model + AdamW; load it onto 2 x 2, 1-D W = 4 and 1-D W = 2 (one per replica)."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415

    model = _sharded_mlp(mesh)
    opt = _train_one_step(model, rank)
    path = os.path.join(tmp, "ckpt")
    flashfsdp.checkpoint.save(path, model, opt, step=1)
    out = {"params": gather_full_params(model), "optim": gather_full_optimizer_state(model, opt), "loaded": {}}
    if rank == 0:
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
        out["chunk_cover"] = {k: (sum(c.sizes.numel() for c in m.chunks), m.size.numel())
                              for k, m in meta.items() if hasattr(m, "chunks")}
    for name, target in (("2x2", mesh), ("1d_w4", None), ("1d_w2", mesh["shard"])):
        other = _sharded_mlp(target, seed=1)
        other_opt = _train_one_step(other, rank)  # optimizer state to overwrite
        flashfsdp.checkpoint.load(path, other, other_opt)
        out["loaded"][name] = {"params": gather_full_params(other), "optim": gather_full_optimizer_state(other, other_opt)}
    out["dsd_1d"] = _dsd_roundtrip(model, tmp)
    # the full state dict from global rank 0 into another HSDP model: ranks 2 and 3 are their shard
    # group's rank 0 but not the source
    full = flashfsdp.get_full_state_dict(model)
    other = _sharded_mlp(mesh, seed=3)
    flashfsdp.set_full_state_dict(other, full if rank == 0 else None)
    out["full_sd_2x2"] = gather_full_params(other)
    return out


def _dsd_roundtrip(model, tmp) -> dict:
    """The stock get_model_state_dict of the HSDP model, saved by dcp and set into a 1-D model."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: PLC0415

    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(tmp, "dsd"))
    other = _sharded_mlp(None, seed=2)
    state = get_model_state_dict(other)
    dcp.load(state, checkpoint_id=os.path.join(tmp, "dsd"))
    set_model_state_dict(other, state)
    return gather_full_params(other)


def _bad_meshes(rank) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: PLC0415

    cases = {
        "3d": lambda: init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "replicate", "shard")),
        "no_names": lambda: init_device_mesh("cpu", (R, S)),
        "swapped_names": lambda: _mesh(("shard", "replicate")),
        "not_this_rank": lambda: DeviceMesh("cpu", [0, 1]),
    }
    errors = {}
    for name, build in cases.items():
        mesh = build()  # collective: every rank builds every mesh
        if name == "not_this_rank" and rank < 2:
            continue
        try:
            _sharded_mlp(mesh)
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
    model = _sharded_mlp(_mesh())
    try:
        model.set_all_reduce_hook(lambda t: None, stream=object())
        errors["hook_stream"] = None
    except ValueError as exc:
        errors["hook_stream"] = ("ValueError", str(exc))
    return errors


def _hsdp_run(rank, world_size, tmp) -> dict:
    mesh = _mesh()
    return {"training": _training(rank, mesh), "bytes": _bytes_per_step(rank, mesh),
            "switch": _all_reduce_switch(rank, mesh), "checkpoints": _checkpoints(rank, mesh, tmp),
            "bad": _bad_meshes(rank)}


# ---------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    return run_distributed(_hsdp_run, W, str(tmp_path_factory.mktemp("hsdp")))


def test_training_matches_the_reference_and_torch_hsdp(hsdp):
    ref = train_reference("mlp", W, steps=2)
    for result in hsdp:
        got, torch_run = result["training"]["fp32"], result["training"]["torch_fp32"]
        torch.testing.assert_close(got["losses"], ref["losses"], **FP32)
        torch.testing.assert_close(got["losses"], torch_run["losses"], **FP32)
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, **FP32, msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(got["params"][name], torch_run["params"][name], **FP32)


def test_mixed_precision_matches_torch_hsdp(hsdp):
    for result in hsdp:
        got, want = result["training"]["bf16"], result["training"]["torch_bf16"]
        torch.testing.assert_close(got["losses"], want["losses"], **BF16)
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, **BF16, msg=lambda m, n=name: f"{n}: {m}")


def test_gradient_accumulation_with_cpu_offload(hsdp):
    ref = train_reference("mlp", W, steps=1, grad_accum=2)
    for result in hsdp:
        got = result["training"]["accum_offload"]
        torch.testing.assert_close(got["losses"], ref["losses"], **FP32)
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, **FP32, msg=lambda m, n=name: f"{n}: {m}")


def test_bytes_per_step_on_each_group_are_the_analytic_volume(hsdp):
    for rank, result in enumerate(hsdp):
        records, unit_bytes = result["bytes"]["records"], result["bytes"]["expected_unit_bytes"]
        gathered, segment = (sum(u[k] for u in unit_bytes) for k in (0, 1))
        shard = (rank // S * S, rank // S * S + 1)
        replicate = (rank % S, rank % S + S)
        totals: dict = {}
        for kind, ranks, nbytes in records:
            totals[(kind, ranks)] = totals.get((kind, ranks), 0) + nbytes
        assert totals == {
            ("all_gather", shard): 2 * gathered,  # forward and backward, within the shard group
            ("reduce_scatter", shard): S * segment,
            ("all_reduce", replicate): segment,  # this rank's reduced segment across the replicas
        }, f"rank {rank}"


def test_set_requires_all_reduce_accumulates_like_torch(hsdp):
    x, y = make_batch("mlp", 0, 2 * W)
    ref = make_mlp()
    loss_fn("mlp", ref(x), y).backward()
    for result in hsdp:
        switch = result["switch"]
        assert switch["first"] == {"kinds": ["all_gather", "reduce_scatter"], "grads_none": True}
        assert switch["placements"] == {(Replicate(), Shard(0))}  # FSDP2's HSDP placements
        for name, p in ref.named_parameters():
            torch.testing.assert_close(switch["flashfsdp"][name], p.grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(switch["flashfsdp"][name], switch["torch"][name], **FP32)


def test_checkpoint_saved_once_per_replica_set_and_loaded_on_any_mesh(hsdp):
    ckpt = hsdp[0]["checkpoints"]
    # Every element is in the checkpoint's metadata once: the replicas' identical chunks were
    # written by one rank (a copy per replica would cover each element R times).
    assert ckpt["chunk_cover"] and all(saved == numel for saved, numel in ckpt["chunk_cover"].values()), \
        ckpt["chunk_cover"]
    for result in hsdp:
        saved = result["checkpoints"]
        for mesh_name, loaded in saved["loaded"].items():
            for name, want in saved["params"].items():
                torch.testing.assert_close(loaded["params"][name], want, rtol=0, atol=0,
                                           msg=lambda m, n=name, k=mesh_name: f"{k} {n}: {m}")
            torch.testing.assert_close(loaded["optim"], saved["optim"], rtol=0, atol=0)
        for name, want in saved["params"].items():
            torch.testing.assert_close(saved["dsd_1d"][name], want, rtol=0, atol=0)
            torch.testing.assert_close(saved["full_sd_2x2"][name], want, rtol=0, atol=0)


def test_bad_meshes_are_refused(hsdp):
    for rank, result in enumerate(hsdp):
        bad = result["bad"]
        assert bad["3d"][0] == "ValueError" and "3 dimensions" in bad["3d"][1]
        assert bad["no_names"][0] == "ValueError" and "mesh_dim_names" in bad["no_names"][1]
        assert bad["swapped_names"][0] == "ValueError" and "replicates across dim 0" in bad["swapped_names"][1]
        assert bad["hook_stream"][0] == "ValueError" and "native HSDP" in bad["hook_stream"][1]
        if rank >= 2:
            assert bad["not_this_rank"][0] == "ValueError" and "not in the mesh" in bad["not_this_rank"][1]
