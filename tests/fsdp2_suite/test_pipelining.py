"""Pipeline parallelism (``torch.distributed.pipelining``) over fully_shard'ed stages, FSDP2 vs flashfsdp.

No upstream FSDP2 file tests this; torch's pipelining tests (``test/distributed/pipelining``) run
FSDP2 stages on GPUs. Here every schedule torch 2.13 ships runs on a ``(pp, dp)`` mesh of (2, 2)
at W = 4 on gloo, as torchtitan builds it: each stage's blocks and the stage module are
fully_shard'ed over ``mesh["dp"]`` and the stage is a ``PipelineStage`` over ``mesh["pp"]``; the
multi-stage schedules hold two stages per rank (looped, or a "V" for ZBV and DualPipeV). After
the micro-batches torch's pipelining turns gradient sync back on and calls, through
``fully_shard.state(stage_module)``, each unit's ``post_backward()`` and the root's final callback
(``flashfsdp/bindings/torch_state.py``). Each case checks the losses and the parameters after two
optimizer steps against the unsharded model trained on every data-parallel rank's batch (so the
torch run is checked too), and the runner compares flashfsdp's with torch's.

The zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) split each backward into an input pass and a weight pass; torch's weight
pass finds the parameters through ``submod.parameters()`` at the input pass, so the units must
keep their unsharded parameters after forward (``reshard_after_forward=False``, as torchtitan
sets under pipeline parallelism): with resharding after forward both FSDP2 and flashfsdp lose
those gradients. Those cases shard with ``reshard_after_forward=False``; the others with the default.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.fsdp2_suite.common import FP32
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

DIM, BATCH, MICROBATCHES, STEPS, LAYERS_PER_STAGE = 16, 8, 4, 2, 2
ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


class Block(nn.Module):
    """A residual MLP block (``w1`` colwise and ``w2`` rowwise under tensor parallelism)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Stage(nn.Module):
    """One pipeline stage: ``LAYERS_PER_STAGE`` blocks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS_PER_STAGE))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s (input, target) of ``step``, the same on every pp/tp rank."""
    gen = torch.Generator().manual_seed(100 + 10 * step + dp_rank)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)


def stage_indices(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """The stages rank ``pp_rank`` holds: one, or two per rank (looped, or a V)."""
    import torch.distributed.pipelining as pipelining  # noqa: PLC0415

    if issubclass(getattr(pipelining, schedule), pipelining.schedules.PipelineScheduleSingle):
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]


def reference(num_stages: int, indices: list[int], dp: int) -> tuple[list[torch.Tensor], dict]:
    """The unsharded model trained as the pipeline trains it (SGD on the mean over data-parallel
    ranks and micro-batches of each micro-batch's mean loss): the losses of every step's
    micro-batches of data-parallel rank 0 .. dp-1 and the parameters of the stages ``indices``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Stage() for _ in range(num_stages)])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    size = BATCH // MICROBATCHES
    for step in range(STEPS):
        optim.zero_grad()
        per_rank = []
        for d in range(dp):
            x, target = batch(step, d)
            mb_losses = []
            for mb in range(MICROBATCHES):
                part = slice(mb * size, (mb + 1) * size)
                loss = loss_fn(model(x[part]), target[part])
                (loss / MICROBATCHES / dp).backward()
                mb_losses.append(loss.detach())
            per_rank.append(torch.stack(mb_losses))
        optim.step()
        losses.append(per_rank)
    params = {f"{i}.{n}": p.detach().clone() for i in indices for n, p in model[i].named_parameters()}
    return losses, params


def parallelize_tp(stage: Stage, tp_mesh) -> None:
    """Megatron-style tensor parallelism of each block: ``w1`` colwise, ``w2`` rowwise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415

    for layer in stage.layers:
        parallelize_module(layer, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def run_pipeline(impl, schedule: str, mesh, reshard_after_forward=None) -> dict:
    """Build the stages of this rank on ``mesh`` (dims "pp", "dp"[, "tp"]), train ``STEPS`` steps of
    ``MICROBATCHES`` micro-batches with ``schedule``, check against :func:`reference`; returns the
    last stage's losses (empty elsewhere) and the full parameters of this rank's stages."""
    import torch.distributed.pipelining as pipelining  # noqa: PLC0415

    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    dp_mesh, dp_rank = mesh["dp"], mesh["dp"].get_local_rank()
    tp_mesh = mesh["tp"] if "tp" in mesh.mesh_dim_names else None
    cls = getattr(pipelining, schedule)
    indices = stage_indices(schedule, pp_rank, pp)
    num_stages = pp * (1 if len(indices) == 1 else 2)
    torch.manual_seed(0)
    modules = [Stage() for _ in range(num_stages)]
    stages, mine = [], []
    for i in indices:
        module = modules[i]
        if tp_mesh is not None:
            parallelize_tp(module, tp_mesh)
        for layer in module.layers:
            impl.fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        impl.fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        mine.append((i, module))
        stages.append(pipelining.PipelineStage(module, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    single = len(indices) == 1
    pipe = cls(stages[0] if single else stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optim = torch.optim.SGD([p for _, m in mine for p in m.parameters()], lr=0.1)
    has_first, has_last = 0 in indices, num_stages - 1 in indices
    losses = []
    for step in range(STEPS):
        x, target = batch(step, dp_rank)
        optim.zero_grad()
        step_losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": step_losses} if has_last else {}
        pipe.step(*((x,) if has_first else ()), **kwargs)
        optim.step()
        if has_last:
            losses.append(torch.stack([loss.detach() for loss in step_losses]))
    params = {f"{i}.{n}": p.full_tensor().detach() for i, m in mine for n, p in m.named_parameters()}
    for tag in ("parameters", "gradients"):
        impl.record_types(f"pipeline {tag}", [p if tag == "parameters" else p.grad for _, m in mine
                                               for p in m.parameters()])
    ref_losses, ref_params = reference(num_stages, indices, dp_mesh.size())
    for step, got in enumerate(losses):
        torch.testing.assert_close(got, ref_losses[step][dp_rank], **FP32, msg=lambda m: f"step {step} losses: {m}")
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], **FP32, msg=lambda m, name=name: f"{name}: {m}")
    return {"losses": torch.stack(losses) if losses else torch.empty(0), "params": params}


def _schedule_case(schedule: str):
    def case(rank, world_size, impl):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        return run_pipeline(impl, schedule, mesh, False if schedule in ZERO_BUBBLE else None)

    case.__name__ = f"pipeline_{schedule}"
    case.__doc__ = (f"{schedule} on a (pp, dp) = (2, 2) mesh"
                    + (", reshard_after_forward=False (zero bubble)" if schedule in ZERO_BUBBLE else "") + ".")
    return case


SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", *ZERO_BUBBLE)
for _schedule in SCHEDULES:
    cases.case(world_size=4)(_schedule_case(_schedule))


@cases.case(world_size=4)
def pipeline_reshard_after_forward_false_1f1b(rank, world_size, impl):
    """Schedule1F1B with ``reshard_after_forward=False`` (torchtitan's setting under pipeline
    parallelism): the units stay unsharded across the micro-batches."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return run_pipeline(impl, "Schedule1F1B", mesh, False)


def _pipeline_collectives(impl) -> list:
    """Interleaved1F1B on a (pp, dp) = (2, 2) mesh for 3 steps; the collectives of the units
    counted in steps 2 and 3 (the first also runs pipelining's shape inference), with the number
    of units of this rank. On flashfsdp, asserts that its control group exchanged nothing in
    those steps although pipelining turns gradient sync off and on again in each."""
    import torch.distributed.pipelining as pipelining  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    indices = stage_indices("ScheduleInterleaved1F1B", pp_rank, 2)
    torch.manual_seed(0)
    modules = [Stage() for _ in range(4)]
    stages = []
    for i in indices:
        for layer in modules[i].layers:
            impl.fully_shard(layer, mesh=dp_mesh)
        impl.fully_shard(modules[i], mesh=dp_mesh)
        stages.append(pipelining.PipelineStage(modules[i], i, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    pipe = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optim = torch.optim.SGD([p for i in indices for p in modules[i].parameters()], lr=0.1)
    control_before, counts = None, []
    for step in range(3):
        x, target = batch(step, dp_mesh.get_local_rank())
        if step == 1 and impl.name == "flashfsdp":
            control_before = _control_messages(impl, modules[indices[0]])
        # (no functional collectives: CommDebugMode cannot run inside pipelining's autograd.grad)
        with impl.count_collectives(functional=False) as counted:
            optim.zero_grad()
            pipe.step(*((x,) if 0 in indices else ()), **({"target": target} if 3 in indices else {}))
        optim.step()
        counts.append(counted)
    if impl.name == "flashfsdp":
        assert _control_messages(impl, modules[indices[0]]) == control_before, "the backward check exchanged again"
    return counts[1:], LAYERS_PER_STAGE * len(indices)  # (the stage modules hold no parameters)


@cases.case(world_size=4, per_unit_collectives=True)
def pipeline_collective_counts_per_unit(rank, world_size, impl):
    """Unit by unit (flashfsdp's buckets off), Interleaved1F1B: one reduce-scatter per unit and
    step, as FSDP2 (compared); all-gathers at most one per unit and micro-batch forward plus one
    for the backward (FSDP2's count with ``reshard_after_forward`` True; flashfsdp keeps the unit
    whose forward ends last for its backward, one fewer per micro-batch)."""
    counts, units = _pipeline_collectives(impl)
    for counted in counts:
        assert units <= counted.all_gather <= units * (MICROBATCHES + 1), (counted, units)
        assert counted.all_reduce == 0, counted
    return [counted.reduce_scatter for counted in counts]


@cases.case(world_size=4)
def pipeline_collective_counts(rank, world_size, impl):
    """flashfsdp's default (buckets on), Interleaved1F1B: at most one reduce-scatter per unit and
    step (fewer: units reduce in shared buckets), all-gathers bounded as unit by unit, and no
    control-group exchange after the first step."""
    counts, units = _pipeline_collectives(impl)
    for counted in counts:
        assert units <= counted.all_gather <= units * (MICROBATCHES + 1), (counted, units)
        assert 1 <= counted.reduce_scatter <= units, (counted, units)
    return {}


def _control_messages(impl, module) -> int:
    """Control messages exchanged so far over the control group of ``module``'s communicator
    (flashfsdp's agreement checks)."""
    from flashfsdp.runtime import control  # noqa: PLC0415

    ctl = control.for_comm(impl.fully_shard.state(module).unit.comm)
    return ctl.seq


@cases.case(world_size=4)
def pipeline_tensor_parallel_1f1b(rank, world_size, impl):
    """Schedule1F1B on a (pp, dp, tp) = (2, 1, 2) mesh: each block Megatron-style tensor parallel
    over ``mesh["tp"]``, then fully_shard'ed over ``mesh["dp"]`` (a 1-rank data-parallel dim, so
    W = 4; the parameters are DTensors over (dp, tp), their gradients reduced by the units)."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    return run_pipeline(impl, "Schedule1F1B", mesh)


@cases.case(world_size=4)
def pipeline_tensor_parallel_interleaved_1f1b(rank, world_size, impl):
    """ScheduleInterleaved1F1B (two stages per rank) on a (pp, dp, tp) = (2, 1, 2) mesh (W = 4)."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    return run_pipeline(impl, "ScheduleInterleaved1F1B", mesh)


@cases.case(world_size=4)
def pipeline_tensor_parallel_interleaved_zero_bubble(rank, world_size, impl):
    """ScheduleInterleavedZeroBubble on a (pp, dp, tp) = (2, 1, 2) mesh, reshard_after_forward=False (W = 4)."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    return run_pipeline(impl, "ScheduleInterleavedZeroBubble", mesh, False)


test_case = cases.pytest_tests()
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
