"""Rank-disagreement cases at W = 2 for the tests (``test_disagreement.py``) and ``benchmarks.soak``.

Each case runs in a fresh gloo group with a short collective timeout (:func:`short_timeout_group`:
the harness's group is swapped for one made here, then for a healthy one again, so that the
spawner's closing barrier runs on a group no case broke) and returns what each rank raised:
``("ok", value)`` or ``("error", class name, message)``. The model: a Sequential of three
fully_shard'ed linear layers of different widths (so mismatched collectives differ in size) and
the root; rank r trains on its own batches.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

TIMEOUT_S = 2.0
DESYNC_WINDOW_S = 1.0  # the desync cases' window (the default is 5 s)
_parted: list = [None]  # time.monotonic() of this rank's divergent call in the running case


def part() -> None:
    """Mark this rank's divergent call (the case's duration is counted from here)."""
    _parted[0] = time.monotonic()


@contextlib.contextmanager
def short_timeout_group(store_dir: str, name: str, rank: int, world_size: int, timeout_s: float | None = TIMEOUT_S):
    """The default group replaced by one with a ``timeout_s`` collective timeout (None: torch's
    default) over the file store ``<store_dir>/<name>``; afterwards by a fresh group with the
    default timeout."""
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    _swap_group(os.path.join(store_dir, name), rank, world_size, timeout)
    try:
        yield
    finally:
        gc.collect()
        _swap_group(os.path.join(store_dir, name + ".after"), rank, world_size, None)


def _swap_group(store: str, rank: int, world_size: int, timeout) -> None:
    """Destroy the default group, wait until every rank has (a file-store barrier: gloo's
    connections of a new group must not meet those of one being torn down), then create a new
    one over the file store ``store``."""
    from flashfsdp.runtime.comm_factory import forget_communicators  # noqa: PLC0415

    forget_communicators()  # nothing keeps the old groups alive while the new one connects
    gc.collect()
    dist.destroy_process_group()
    barrier = dist.FileStore(store + ".swap", world_size)
    barrier.add("destroyed", 1)
    while int(barrier.add("destroyed", 0)) < world_size:
        time.sleep(0.01)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, **kwargs)


def model(seed: int = 0, **kwargs) -> nn.Sequential:
    """Three fully_shard'ed linear layers of different widths, and the root (``kwargs``: for
    every fully_shard call)."""
    from flashfsdp import fully_shard  # noqa: PLC0415

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))
    for i in (0, 2, 4):
        fully_shard(net[i], **kwargs)
    return fully_shard(net, **kwargs)


def step(net: nn.Module, rank: int, i: int, backward: bool = True) -> float:
    """One forward (and backward) on rank ``rank``'s batch ``i``; returns the loss."""
    torch.manual_seed(100 * rank + i)
    loss = net(torch.randn(4, 8)).square().mean()
    if backward:
        loss.backward()
    return float(loss)


def outcome(fn, *args):
    """``("ok", fn(*args))`` or ``("error", class name, message)``."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return ("error", type(exc).__name__, str(exc))


# ------------------------------------------------------------------------------------- the cases
def save_vs_forward(rank: int, ckpt: str):
    """One step on both; then rank 0 saves a checkpoint while rank 1 runs the next step."""
    from flashfsdp import checkpoint  # noqa: PLC0415

    net = model()
    step(net, rank, 1)
    part()
    if rank == 0:
        checkpoint.save(ckpt, net, step=1)
    else:
        step(net, rank, 2)


def save_vs_first_forward(rank: int, ckpt: str):
    """Rank 0 saves before any forward while rank 1 runs its first forward."""
    from flashfsdp import checkpoint  # noqa: PLC0415

    net = model()
    if rank == 0:
        checkpoint.save(ckpt, net, step=0)
    else:
        step(net, rank, 1)


def uneven_batches_then_save(rank: int, ckpt: str):
    """Rank 0 has 2 batches, rank 1 has 3; each saves after its last."""
    from flashfsdp import checkpoint  # noqa: PLC0415

    net = model()
    for i in range(2):
        step(net, rank, i)
    part()
    for i in range(2, 2 + rank):
        step(net, rank, i)
    checkpoint.save(ckpt, net, step=2 + rank)


def skipped_backward(rank: int, ckpt: str):
    """Rank 1 runs the second step's forward without its backward; both then save."""
    from flashfsdp import checkpoint  # noqa: PLC0415

    net = model()
    step(net, rank, 1)
    part()
    step(net, rank, 2, backward=rank == 0)
    checkpoint.save(ckpt, net, step=2)


def differing_gradient_sync(rank: int, ckpt: str):
    """Rank 1 turns gradient synchronisation off before the second step; both then save."""
    from flashfsdp import checkpoint  # noqa: PLC0415

    net = model()
    step(net, rank, 1)
    part()
    net.set_requires_gradient_sync(rank == 0)
    step(net, rank, 2)
    checkpoint.save(ckpt, net, step=2)


def int8_on_one_rank(rank: int, ckpt: str):
    """Rank 1 all-gathers in int8 (``MixedPrecisionPolicy(all_gather_dtype=torch.int8)``)."""
    from flashfsdp import MixedPrecisionPolicy  # noqa: PLC0415

    net = model(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               all_gather_dtype=torch.int8 if rank == 1 else None))
    step(net, rank, 1)


def reshard_after_forward_differs(rank: int, ckpt: str):
    """reshard_after_forward True on rank 0, False on rank 1."""
    net = model(reshard_after_forward=rank == 0)
    step(net, rank, 1)


def _states(net: nn.Module) -> tuple:
    """(the root's state, every unit's state in the root's order)."""
    root = net.__dict__["_flashfsdp_state"]
    return root, list(root.ctx.states)


def backward_sync_differs(rank: int, ckpt: str):
    """A forward without grad on both ranks (the same-model check passes); then rank 1 turns
    gradient sync off for unit '2' and both run a step: its backward's first hook checks."""
    net = model()
    step(net, rank, 1, backward=False)
    net[2].set_requires_gradient_sync(rank == 0, recurse=False)
    step(net, rank, 2)


def backward_units_differ(rank: int, ckpt: str):
    """Unit '2''s forward runs without grad on rank 1 (so it has no backward there); both then
    run the backward."""
    import types  # noqa: PLC0415

    net = model()

    def forward(self, x):
        h = self[1](self[0](x))
        with torch.set_grad_enabled(rank == 0):
            h = self[2](h)
        return self[4](self[3](h))

    net.forward = types.MethodType(forward, net)
    step(net, rank, 1)


def backward_check_agrees(rank: int, ckpt: str):
    """Two steps where both ranks agree: the first step's backward checked, the second's did not
    exchange (nothing changed); returns whether a check is still needed."""
    from flashfsdp.bindings.backward_check import needs_check  # noqa: PLC0415

    net = model()
    step(net, rank, 1)
    step(net, rank, 2)
    return needs_check(*_states(net))


def backward_check_accumulation(rank: int, ckpt: str):
    """Three steps of two micro-batches each, gradient sync off for the first and on for the
    second (gradient accumulation): whether each backward needs the check's exchange, and the
    control messages of the steps after the first (none: both combinations were checked)."""
    from flashfsdp.bindings.backward_check import needs_check  # noqa: PLC0415
    from flashfsdp.runtime import control  # noqa: PLC0415

    net = model()
    needed, sent = [], []
    for i in range(3):
        ctl = control.control_group()
        before = None if ctl is None else ctl.seq
        for last in (False, True):
            net.set_requires_gradient_sync(last)
            loss = net(torch.randn(4, 8)).square().mean()
            needed.append(needs_check(*_states(net)))
            loss.backward()
        sent.append(None if ctl is None else ctl.seq - before)
    return needed, sent[1:]


def _ignored_model(rank: int):
    """A sharded layer and an ignored one; the ignored layer's gradient is all-reduced (made equal)
    unless ``rank`` is given, then it stays rank-local."""
    from flashfsdp import fully_shard  # noqa: PLC0415

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(net, ignored_params=set(net[1].parameters()))
    step(net, rank, 1)
    return net


def clip_ignored_params_differ(rank: int, ckpt: str):
    """clip_grad_norm_ over a model whose ignored parameters have rank-local gradients."""
    import flashfsdp  # noqa: PLC0415

    return flashfsdp.clip_grad_norm_(_ignored_model(rank), 1.0).item()


def clip_ignored_params_equal(rank: int, ckpt: str):
    """clip_grad_norm_ once the ignored parameters' gradients are all-reduced: one norm on every rank."""
    import flashfsdp  # noqa: PLC0415

    net = _ignored_model(rank)
    for p in net[1].parameters():
        dist.all_reduce(p.grad)
    return flashfsdp.clip_grad_norm_(net, 1.0).item()


def optimizer_max_grad_norm_mixed(rank: int, ckpt: str):
    """flashfsdp.optim.AdamW(max_grad_norm=...) over sharded and rank-local plain parameters."""
    from flashfsdp.optim import AdamW  # noqa: PLC0415

    net = _ignored_model(rank)
    AdamW(net.parameters(), lr=1e-3, max_grad_norm=1.0).step()


def threaded_state_dict_during_step(rank: int, ckpt: str):
    """Rank 0 is between a forward and its backward, rank 1 after a forward without grad, when a
    thread of each asks for the full state dict."""
    import flashfsdp  # noqa: PLC0415

    net = model()
    step(net, rank, 1)
    with torch.set_grad_enabled(rank == 0):
        step(net, rank, 2, backward=False)
    box = {}
    reader = threading.Thread(target=lambda: box.update(result=outcome(flashfsdp.get_full_state_dict, net)))
    reader.start()
    reader.join()
    if box["result"][0] == "error":
        raise RuntimeError(box["result"][2])
    return sorted(box["result"][1])


def slow_not_desynced(rank: int, ckpt: str):
    """Rank 1 computes for twice the desync window before the second step: slow, not desynced (the
    ranks wait on the same collective); both finish the step. Returns the losses."""
    net = model()
    losses = [step(net, rank, 1)]
    part()
    if rank == 1:
        time.sleep(2 * DESYNC_WINDOW_S)
    losses.append(step(net, rank, 2))
    return losses


def _train_with_reader(rank: int, reader_on: bool) -> tuple:
    """Sixteen steps of a small Llama (bf16 compute, SGD) while a second thread reads
    ``get_model_state_dict`` in a loop (``reader_on``): (losses, snapshots read, the snapshots
    holding anything other than DTensors, the reader's errors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from flashfsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415
    from flashfsdp.models import Llama, LlamaConfig  # noqa: PLC0415

    net = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=16))
    net.init_weights(0)
    for block in net.layers:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    stop, seen = threading.Event(), {"read": 0, "mixed": 0, "errors": []}

    def read():
        while not stop.is_set():
            try:
                state = get_model_state_dict(net)
            except Exception as exc:  # noqa: BLE001 - the reader's errors are the result
                seen["errors"].append(f"{type(exc).__name__}: {exc}")
                continue
            seen["read"] += 1
            seen["mixed"] += any(not isinstance(v, DTensor) for v in state.values())

    reader = threading.Thread(target=read, name="reader")
    if reader_on:
        reader.start()
    losses, tokens = [], torch.Generator().manual_seed(rank)
    for _ in range(16):
        batch = torch.randint(0, 256, (2, 17), generator=tokens)
        loss = nn.functional.cross_entropy(net(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stop.set()
    if reader_on:
        reader.join()
    return losses, seen["read"], seen["mixed"], seen["errors"][:3]


def reader_thread_during_training(rank: int, ckpt: str):
    """Training with and without a thread reading sharded state dicts meanwhile: (the losses are
    the same, snapshots read, snapshots holding plain tensors, the reader's errors)."""
    alone, _, _, _ = _train_with_reader(rank, False)
    losses, read, mixed, errors = _train_with_reader(rank, True)
    return losses == alone, read > 0, mixed, errors


def full_state_dict_from_a_thread(rank: int, ckpt: str):
    """Between two steps, a thread of each rank asks for the full state dict: what it raised and
    the control messages sent meanwhile (none: refused before any collective)."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.runtime import control  # noqa: PLC0415

    net = model()
    step(net, rank, 1)
    ctl = control.control_group()
    before, box = ctl.seq, {}
    reader = threading.Thread(target=lambda: box.update(result=outcome(flashfsdp.get_full_state_dict, net)))
    reader.start()
    reader.join()
    sent = ctl.seq - before
    step(net, rank, 2)  # training goes on
    return box["result"][:2], box["result"][2] if box["result"][0] == "error" else None, sent


CASES = {
    "save_vs_forward": save_vs_forward,
    "save_vs_first_forward": save_vs_first_forward,
    "uneven_batches_then_save": uneven_batches_then_save,
    "skipped_backward": skipped_backward,
    "differing_gradient_sync": differing_gradient_sync,
    "int8_on_one_rank": int8_on_one_rank,
    "reshard_after_forward_differs": reshard_after_forward_differs,
    "backward_sync_differs": backward_sync_differs,
    "backward_units_differ": backward_units_differ,
    "backward_check_agrees": backward_check_agrees,
    "backward_check_accumulation": backward_check_accumulation,
    "clip_ignored_params_differ": clip_ignored_params_differ,
    "clip_ignored_params_equal": clip_ignored_params_equal,
    "optimizer_max_grad_norm_mixed": optimizer_max_grad_norm_mixed,
    "threaded_state_dict_during_step": threaded_state_dict_during_step,
    "reader_thread_during_training": reader_thread_during_training,
    "full_state_dict_from_a_thread": full_state_dict_from_a_thread,
}
# Run with the process group's default timeout and a short desync window (``run_desync_cases``).
DESYNC_CASES = {
    "save_vs_forward": save_vs_forward,
    "uneven_batches_then_save": uneven_batches_then_save,
    "skipped_backward": skipped_backward,
    "differing_gradient_sync": differing_gradient_sync,
    "slow_not_desynced": slow_not_desynced,
}


def trace_dir(store_dir: str, name: str) -> str:
    """Where the ranks dump their flight recorders in case ``name``."""
    return os.path.join(store_dir, f"trace_{name}")


CLIP_CASES = ("clip_ignored_params_differ", "clip_ignored_params_equal", "optimizer_max_grad_norm_mixed")


def run_case(rank: int, world_size: int, name: str, store_dir: str, timeout_s: float | None = TIMEOUT_S) -> tuple:
    """Rank ``rank``'s outcome of case ``name`` and the seconds it took to raise (or return), from
    its divergent call (:func:`part`) where it marks one, else from its start; ``timeout_s``: the
    group's collective timeout (None: torch's default)."""
    from flashfsdp.runtime import flight  # noqa: PLC0415

    flight.configure()  # each case from seq 0 on both ranks, whatever the cases before did
    os.environ["FLASHFSDP_TRACE_DIR"] = trace_dir(store_dir, name)
    with short_timeout_group(store_dir, name, rank, world_size, timeout_s):
        _parted[0] = None
        start = time.monotonic()
        result = outcome(CASES.get(name) or DESYNC_CASES[name], rank, os.path.join(store_dir, f"ckpt_{name}"))
        return result, time.monotonic() - (_parted[0] or start)


def run_cases(rank: int, world_size: int, names: list[str], store_dir: str) -> dict:
    """:func:`run_case` for each of ``names``, in turn."""
    return {name: run_case(rank, world_size, name, store_dir) for name in names}


def run_desync_cases(rank: int, world_size: int, names: list[str], store_dir: str) -> dict:
    """:func:`run_case` for each of ``names`` under the process group's default timeout (30 min
    with gloo) and a desync window of :data:`DESYNC_WINDOW_S` seconds."""
    from flashfsdp import debug  # noqa: PLC0415

    debug.set_desync_window(DESYNC_WINDOW_S)
    try:
        return {name: run_case(rank, world_size, name, store_dir, None) for name in names}
    finally:
        debug.set_desync_window()
