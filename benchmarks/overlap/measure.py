"""What the overlap validation measures, in each of the two rank processes (see the package
docstring, 1 (a)-(d)): the link (:class:`_LinkCalibration`), host contention
(:class:`_ContentionProbe`), the comm-free twin's compute and the optimizer step, and the W = 2 steps
under every schedule of :data:`SCHEDULES`, interleaved round by round.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from flashfsdp import sim
from flashfsdp.sim import calibrate

# The contention probe's collective: long enough (tens of ms) that the overlapped kernel spans many
# scheduler time slices; the rates are taken as the same for the model's smaller collectives.
PROBE_BYTES = 32 * 2**20
QUICK_PROBE_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Config:
    """A validation model: Llama shape, per-rank batch and optimizer."""

    name: str
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    optimizer: str = "adamw"  # "adamw" or "sgd"

    def describe(self) -> str:
        """One line for notes."""
        return (f"{self.name}: Llama dim {self.dim}, {self.layers} layers, {self.heads} heads, seq {self.seq}, "
                f"{self.batch} sequence(s) per rank, fp32, {self.optimizer.upper()}")


CONFIGS = {
    # Compute-bound: the validation model of the first results (compute ~90% of the step).
    "compute-bound": Config("compute-bound", dim=256, layers=6, heads=4, seq=128, batch=4),
    # Communication-heavy: wide, shallow blocks and 8 tokens per rank, plain SGD: per-parameter
    # compute is at its floor, so all-gathers and reduce-scatters weigh about as much as compute.
    "comm-heavy": Config("comm-heavy", dim=768, layers=3, heads=4, seq=8, batch=1, optimizer="sgd"),
}
QUICK_CONFIGS = {  # toy sizes for a smoke test
    "compute-bound": Config("compute-bound", dim=64, layers=2, heads=2, seq=32, batch=2),
    "comm-heavy": Config("comm-heavy", dim=128, layers=2, heads=2, seq=4, batch=1, optimizer="sgd"),
}


SCHEDULES = {
    "fwd+bwd (default)": sim.Setting("fwd+bwd (default)"),
    "no prefetch (max_inflight 0)": sim.Setting("no prefetch (max_inflight 0)", max_inflight=0),
    "reshard_after_forward=False": sim.Setting("reshard_after_forward=False", reshard_after_forward=False),
}
DEFAULT = "fwd+bwd (default)"


# ------------------------------------------------------------------------------ calibration


def _issue(comm, kind: str, full: torch.Tensor, shard: torch.Tensor):
    if kind == "all_gather":
        return comm.all_gather_into_tensor(full, shard)
    return comm.reduce_scatter_tensor(shard, full, op="sum")


class _LinkCalibration:
    """Times gloo all-gathers and reduce-scatters of fp32 buffers alone (unsharded sizes in bytes),
    from the return of the issuing call to the end of ``wait()``: what runs on gloo's thread. (Gloo's
    reduce-scatter clones its input inside the issuing call, on the calling thread: that copy is
    host compute, and the comm-free twin's own reduce-scatter copy of the same size stands for it.)

    One :meth:`round` runs every size and both collectives once; rounds are interleaved with the
    measured steps, so the link is fitted under the same load from other jobs as the steps.
    """

    KINDS = ("all_gather", "reduce_scatter")

    def __init__(self, comm, sizes: list[int]):
        self.comm = comm
        self.world_size = comm.world_size
        self.totals = [max(1, nbytes // 4 // self.world_size) * self.world_size for nbytes in sizes]
        self.tensors = [(torch.ones(total), torch.ones(total // self.world_size)) for total in self.totals]
        self.samples = {(kind, i): [] for kind in self.KINDS for i in range(len(sizes))}

    def round(self, record: bool = True) -> None:
        """Every size and both collectives once (``record=False``: a warm-up round)."""
        import torch.distributed as dist  # noqa: PLC0415

        for (kind, i), times in self.samples.items():
            full, shard = self.tensors[i]
            dist.barrier()
            work = _issue(self.comm, kind, full, shard)
            t0 = time.perf_counter()
            work.wait()
            if record:
                times.append(time.perf_counter() - t0)

    def results(self) -> dict:
        """``{kind: [(nbytes, W, median seconds), ...]}``, the input of ``sim.fit_link``."""
        return {kind: [(total * 4, self.world_size, statistics.median(self.samples[kind, i]))
                       for i, total in enumerate(self.totals)] for kind in self.KINDS}


class _ContentionProbe:
    """Measures host contention (see ``flashfsdp.sim.contention``): per collective kind, a matmul of
    the model's shape ((tokens, dim) @ (dim, ffn_dim), repeated ``n`` times, ``c`` seconds) and a
    collective of ``nbytes`` (``m`` seconds, issue call excluded), alone, then at once. ``n`` is set
    in the first round so that the kernel lasts about a quarter of the collective (which must outlast
    it). A kernel of a millisecond or two would measure the scheduler's wake-up delay rather than
    the steady sharing of the core: hence a collective of :data:`PROBE_BYTES` at least."""

    def __init__(self, comm, nbytes: int, tokens: int, dim: int, ffn_dim: int):
        self.comm = comm
        w = comm.world_size
        total = max(1, nbytes // 4 // w) * w
        self.full, self.shard = torch.ones(total), torch.ones(total // w)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(tokens, dim, generator=gen)
        self.w = torch.randn(dim, ffn_dim, generator=gen)
        self.n: dict[str, int] = {}
        self.samples: dict[str, list] = {kind: [] for kind in _LinkCalibration.KINDS}
        self.dropped = {kind: 0 for kind in _LinkCalibration.KINDS}

    def _kernel(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(self.x, self.w)
        return time.perf_counter() - t0

    def _alone(self, kind: str) -> float:
        import torch.distributed as dist  # noqa: PLC0415

        dist.barrier()
        work = _issue(self.comm, kind, self.full, self.shard)
        t0 = time.perf_counter()
        work.wait()
        return time.perf_counter() - t0

    def round(self, record: bool = True) -> None:
        """One sample per collective kind (``record=False``: a warm-up round that sets ``n``)."""
        import torch.distributed as dist  # noqa: PLC0415

        for kind in self.samples:
            m = self._alone(kind)
            if kind not in self.n:
                self._kernel(3)
                chunk = self._kernel(10) / 10
                # both ranks must run the same kernel: agree on the larger estimate
                n = torch.tensor([max(1, round(m / 4 / max(chunk, 1e-6)))])
                dist.all_reduce(n, op=dist.ReduceOp.MAX)
                self.n[kind] = int(n)
            dist.barrier()
            c = self._kernel(self.n[kind])
            dist.barrier()
            work = _issue(self.comm, kind, self.full, self.shard)
            c_ov = self._kernel(self.n[kind])
            t0 = time.perf_counter()
            work.wait()
            wait = time.perf_counter() - t0
            if not record:
                continue
            if wait > 0.02 * m:
                self.samples[kind].append((c, c_ov, m, wait))
            else:  # the collective finished inside the kernel: this sample cannot give its rate
                self.dropped[kind] += 1


# ------------------------------------------------------------------------------ the measured steps


def _build(config: Config, communicator="auto", mesh=None):
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415

    model = Llama(LlamaConfig(dim=config.dim, n_layers=config.layers, n_heads=config.heads, max_seq_len=config.seq))
    model.init_weights(0)
    for block in model.layers:
        flashfsdp.fully_shard(block, communicator=communicator, mesh=mesh)
    flashfsdp.fully_shard(model, communicator=communicator, mesh=mesh)
    return model


def _optimizer(config: Config, params):
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4)


class _Trainer:
    """One model, its optimizer and a batch stream; :meth:`step` trains one step and records the
    time spent outside the units (batch, optimizer step, zero_grad)."""

    def __init__(self, model, config: Config, seed: int):
        self.model, self.config = model, config
        self.opt = _optimizer(config, model.parameters())
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = model.config.vocab_size
        self.outside: list[float] = []

    def step(self) -> float:
        """One step; returns its wall time in seconds."""
        c = self.config
        t0 = time.perf_counter()
        tokens = torch.randint(0, self.vocab, (c.batch, c.seq + 1), generator=self.gen)
        t1 = time.perf_counter()
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.outside.append((t1 - t0) + (t3 - t2))
        return t3 - t0


class _OptimizerProbe:
    """The W = 2 run's optimizer step on copies of its shard-sized parameters with random
    gradients, timed with no collective in flight (plus a batch draw and zero_grad, like
    :meth:`_Trainer.step`'s outside time)."""

    def __init__(self, model, config: Config):
        self.params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        self.grads = [torch.randn_like(p) for p in self.params]
        self.opt = _optimizer(config, self.params)
        self.config = config
        self.gen = torch.Generator().manual_seed(7)

    def measure(self) -> float:
        """One optimizer step (with the batch draw and zero_grad), in seconds."""
        c = self.config
        for p, g in zip(self.params, self.grads):
            p.grad = g
        t0 = time.perf_counter()
        torch.randint(0, 256, (c.batch, c.seq + 1), generator=self.gen)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def _unit_meta(model) -> dict:
    """By unit name: its elements, parameter bytes and reduction bytes per element."""
    meta = {}
    for unit in (m._flashfsdp_state.unit for m in model.modules() if hasattr(m, "_flashfsdp_state")):
        meta[unit.name] = {
            "numel": sum(g.layout.gathered_size for g in unit.groups),  # W·S: what an all-gather lands
            "param_bytes": max((g.param_dtype.itemsize for g in unit.groups), default=4),
            "reduce_bytes": (unit.reduce_dtype or unit.groups[0].param_dtype).itemsize if unit.groups else 4,
        }
    return meta


def _apply(model, setting: sim.Setting) -> None:
    """Give the runtime the schedule of ``setting`` through the public FSDPModule API."""
    assert setting.forward and setting.backward and setting.depth == 1, "only max_inflight and reshard vary here"
    model.set_max_inflight_all_gathers(setting.max_inflight)
    model.set_reshard_after_forward(setting.reshard_after_forward)
    model.set_bucket_bytes(setting.bucket_bytes or 0)  # the settings here: unit by unit, as simulated


class _Samples:
    """What one configuration's rounds measured on this rank: per schedule the timed and traced
    steps, the time outside the units and the traced inputs; the twin's steps and inputs; the
    optimizer step."""

    def __init__(self):
        self.timed = {s: [] for s in SCHEDULES}
        self.traced = {s: [] for s in SCHEDULES}
        self.inputs = {s: [] for s in SCHEDULES}
        self.outside = {s: [] for s in SCHEDULES}
        self.last_spans: dict[str, list] = {}
        self.twin_timed, self.twin_inputs, self.optimizer = [], [], []

    def schedules_round(self, trainer: _Trainer, shard_bytes: dict[str, int]) -> None:
        """Every schedule once: a settling step, a timed one and a traced one."""
        import flashfsdp  # noqa: PLC0415

        for name, setting in SCHEDULES.items():
            _apply(trainer.model, setting)
            trainer.step()  # settle under the new schedule
            self.timed[name].append(trainer.step() * 1e3)
            with flashfsdp.profile("cpu") as prof:
                self.traced[name].append(trainer.step() * 1e3)
            self.outside[name].append(trainer.outside[-1] * 1e3)
            self.inputs[name].extend(calibrate.inputs_from_profile(prof, shard_bytes))
            self.last_spans[name] = calibrate.timeline_of_profile(prof)
        _apply(trainer.model, SCHEDULES[DEFAULT])

    def twin_round(self, twin: _Trainer, optimizer: _OptimizerProbe, full_bytes: dict[str, int],
                   world_size: int) -> None:
        """The comm-free twin on both ranks at once, as the W = 2 steps run, then the optimizer."""
        import torch.distributed as dist  # noqa: PLC0415

        import flashfsdp  # noqa: PLC0415

        dist.barrier()
        self.twin_timed.append(twin.step() * 1e3)
        dist.barrier()
        with flashfsdp.profile("cpu") as prof:
            twin.step()
        self.twin_inputs.extend(calibrate.inputs_from_profile(prof, full_bytes, accumulate_scale=1.0 / world_size))
        dist.barrier()
        self.optimizer.append(optimizer.measure() * 1e3)

    def summary(self) -> dict:
        """Medians over the rounds (the twin's rounds kept as well, for per-round predictions)."""
        med = statistics.median
        return {
            "schedules": {s: {"step_ms": med(self.timed[s]), "traced_step_ms": med(self.traced[s]),
                              "outside_ms": med(self.outside[s]), "inputs": calibrate.median_inputs(self.inputs[s]),
                              "spans": self.last_spans[s]} for s in SCHEDULES},
            "twin": {"step_ms": med(self.twin_timed), "inputs": calibrate.median_inputs(self.twin_inputs),
                     "optimizer_ms": med(self.optimizer), "rounds": self.twin_inputs,
                     "optimizer_rounds": self.optimizer},
        }


def _measure_config(rank: int, world_size: int, args, config: Config, link_cal: _LinkCalibration) -> dict:
    """Everything measured for one configuration on this rank (see the package docstring, 1 (b)-(d))."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    from flashfsdp.runtime.communicator import LocalCommunicator  # noqa: PLC0415

    model = _build(config)
    # the twin's DTensor parameters live on a mesh of this rank alone, as its communicator does
    own_group, _ = dist.new_subgroups(group_size=1)
    twin = _build(config, communicator=LocalCommunicator(), mesh=DeviceMesh.from_group(own_group, "cpu"))
    trainer = _Trainer(model, config, 1000 + rank)
    twin_trainer = _Trainer(twin, config, 1000 + rank)
    for _ in range(args.warmup):  # the first forward makes the root context and names the units
        trainer.step()
        twin_trainer.step()
    meta = _unit_meta(model)
    optimizer_probe = _OptimizerProbe(model, config)
    block = max(meta.values(), key=lambda m: m["numel"])
    probe_bytes = max(QUICK_PROBE_BYTES if args.quick else PROBE_BYTES, block["numel"] * 4)
    probe = _ContentionProbe(link_cal.comm, probe_bytes, config.batch * config.seq, config.dim, model.config.ffn_dim)
    probe.round(record=False)
    shard_bytes = {n: m["numel"] // world_size * m["param_bytes"] for n, m in meta.items()}
    full_bytes = {n: m["numel"] * m["param_bytes"] for n, m in meta.items()}
    samples = _Samples()
    for _ in range(args.steps):
        link_cal.round()
        probe.round()
        samples.schedules_round(trainer, shard_bytes)
        samples.twin_round(twin_trainer, optimizer_probe, full_bytes, world_size)
    return {
        **samples.summary(),
        "contention": probe.samples, "contention_dropped": probe.dropped, "contention_n": probe.n,
        "units": meta, "params": sum(v["numel"] for v in meta.values()),
    }


def measure_rank(rank: int, world_size: int, args, configs: list[Config], sizes: list[int]) -> dict:
    """Calibrate the link and measure every configuration on this rank (one process per rank)."""
    from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415
    from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

    torch.set_num_threads(1)
    # CPU tensors run the plain-torch reference kernels, whatever TRITON_INTERPRET says (the Triton
    # interpreter, which test suites turn on, would time the interpreter instead).
    with use_backend("reference"):
        link_cal = _LinkCalibration(ProcessGroupCommunicator(), sizes)
        link_cal.round(record=False)
        configs_out = {c.name: _measure_config(rank, world_size, args, c, link_cal) for c in configs}
    return {"configs": configs_out, "calibration": link_cal.results()}
