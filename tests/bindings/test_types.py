"""FSDP2's types, not only its numbers: what client code reads of a flashfsdp model equals what it
reads of a torch FSDP2 model on the same seeds (W = 2 and W = 3, gloo), and the single-process case.

Per parameter after ``fully_shard`` and after a backward: the class (``nn.Parameter`` holding a
``DTensor``), placements, mesh size, global shape and stride, ``to_local()`` shape and values
(FSDP2's dim-0 chunks, also uneven and empty ones), the gradient's class, placements and local
values; per module: ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` and the class name;
``state_dict()`` value types; the DTensor's own operations (``full_tensor``, ``redistribute``)
on the chunks' views; parameters deep-copy and pickle (no reference to the unit rides on them). Also the refusals FSDP2 shares (0-dim parameters) and the ones it does not
(parameters that already are DTensors: not supported yet), and a one-process model without
``torch.distributed`` (plain tensors: no mesh to put a DTensor on).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

from tests.harness import run_distributed


class Net(nn.Module):
    """Sizes chosen so that W = 2 and 3 give uneven chunks and W = 3 an empty one (rows 2 < 3)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 2)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum(-1) * self.scale.sum()


def _describe(model: nn.Module) -> dict:
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    out = {"modules": [(type(m).__name__, isinstance(m, FSDPModule)) for m in model.modules()]}
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), (name, type(p))
        g = p.grad
        out[name] = {
            "placements": [str(pl) for pl in p.placements], "mesh": p.device_mesh.size(),
            "shape": tuple(p.shape), "stride": p.stride(), "dim": p.dim(), "numel": p.numel(),
            "local": p.to_local().detach().clone(), "full": p.full_tensor().detach().clone(),
            "grad_type": type(g).__name__, "grad_placements": [str(pl) for pl in g.placements],
            "grad_local": g.to_local().clone(), "grad_full": g.full_tensor().clone(),
            "requires_grad": p.requires_grad,
        }
    sd = model.state_dict()
    out["state_dict"] = {k: (type(v).__name__, tuple(v.shape), tuple(v.to_local().shape)) for k, v in sd.items()}
    return out


def _both(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415

    torch.manual_seed(0)
    base = Net()
    results = {}
    for name, fully_shard in (("torch", torch_fully_shard), ("flashfsdp", flashfsdp.fully_shard)):
        model = copy.deepcopy(base)
        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
        torch.manual_seed(1 + rank)
        model(torch.randn(4, 5)).sum().backward()
        results[name] = _describe(model)
        # parameters and their state copy and pickle (copy.deepcopy(optimizer.state) copies its keys,
        # the parameters, with their gradients): no reference to the unit rides on them. (torch's
        # FSDP2 fails this at W = 3: its gradients are DTensors over views at nonzero offsets of
        # the reduce-scatter output, which torch's copy takes for plain tensors.)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        optim.step()
        try:
            results[name]["copies"] = [type(k).__name__ for k in copy.deepcopy(optim.state)]
        except RuntimeError as e:
            results[name]["copies"] = str(e)
        results[name]["pickled"] = len(pickle.dumps(list(model.parameters()))) > 0
    return results


@pytest.fixture(scope="module", params=[2, 3])
def described(request):
    return run_distributed(_both, request.param)


def test_parameters_gradients_and_state_dict_are_fsdp2s(described):
    for rank, got in enumerate(described):
        want, flash = got["torch"], got["flashfsdp"]
        assert [n for n, _ in flash["modules"]] == [n for n, _ in want["modules"]]
        assert [f for _, f in flash["modules"]] == [f for _, f in want["modules"]] == [True, True, True]
        assert flash["state_dict"] == want["state_dict"]
        assert flash["copies"] == ["DTensor"] * 5 and flash["pickled"], flash["copies"]
        for name in ("a.weight", "a.bias", "b.weight", "b.bias", "scale"):
            f, w = flash[name], want[name]
            for key in ("placements", "mesh", "shape", "stride", "dim", "numel", "grad_type", "grad_placements",
                        "requires_grad"):
                assert f[key] == w[key], (rank, name, key, f[key], w[key])
            for key in ("local", "full", "grad_local", "grad_full"):
                assert f[key].shape == w[key].shape, (rank, name, key)
                torch.testing.assert_close(f[key], w[key], rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name} {key}")


def _refusals(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415

    messages = []
    scalar = nn.Linear(2, 2)
    scalar.register_parameter("s", nn.Parameter(torch.tensor(1.0)))
    try:
        flashfsdp.fully_shard(scalar)
    except ValueError as e:
        messages.append(str(e))
    tp = nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (world_size,))
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(1)]))
    try:  # tensor parallelism needs the data-parallel dim of the TP mesh's root mesh
        flashfsdp.fully_shard(tp)
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_refusals_name_the_parameter():
    for messages in run_distributed(_refusals, 2):
        assert len(messages) == 2, messages
        assert "scalar parameters" in messages[0] and "s to a 1D tensor" in messages[0]
        assert "'weight'" in messages[1] and "cannot be joined" in messages[1] and "mesh['dp']" in messages[1]


def test_one_process_without_torch_distributed_gets_plain_full_tensors():
    import flashfsdp  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    flashfsdp.fully_shard(model.a)
    flashfsdp.fully_shard(model)
    assert isinstance(model, FSDPModule) and isinstance(model.a, FSDPModule)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert type(p) is nn.Parameter and p.shape == q.shape and torch.equal(p, q), name
    x = torch.randn(3, 5)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert type(p.grad) is torch.Tensor and torch.allclose(p.grad, q.grad)
