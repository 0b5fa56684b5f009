"""State dicts of fully_shard'ed models: sharded (DCP), full, optimizer, and interoperability with FSDP2.

One W = 2 run does the multi-rank work (sharded DCP save/load, full state dicts after init and after
training, both directions of full and sharded checkpoints with ``torch.distributed.fsdp.fully_shard``);
the W = 1 load of its sharded checkpoint and the error cases run in the test process itself.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from torch.distributed.tensor import DTensor, Replicate, Shard

import flashfsdp
from flashfsdp import get_full_state_dict, set_full_state_dict
from flashfsdp.kernels.dispatch import use_backend
from tests.harness import run_distributed
from tests.models import llama_units, loss_fn, make_batch, make_llama
from tests.training import gather_full_optimizer_state, train_flashfsdp, train_reference

FP32_PARAMS = dict(rtol=1e-5, atol=1e-5)
EXACT = dict(rtol=0, atol=0)


def _llama(seed: int = 0):
    """The test Llama plus a persistent buffer (the rotary tables are not persistent)."""
    model = make_llama(seed)
    model.norm.register_buffer("calibration", torch.arange(4.0) + seed)
    return model


def _sharded(model, shard=flashfsdp.fully_shard):
    for unit in llama_units(model):
        shard(unit)
    return model


def _fsdp2(seed: int):
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    return _sharded(_llama(seed), fully_shard)


def _assert_same(got: dict, want: dict, **tol) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], msg=lambda m: f"{key}: {m}", **(tol or EXACT))


def _adam_step(model, lr: float = 1e-2, seed: int = 0, whole_batch: bool = False):
    """An Adam over ``model`` after one step on the global batch of ``seed`` (this rank's rows, or all)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = make_batch("llama", seed, 4)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() and not whole_batch else (1, 0)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    loss_fn("llama", model(x[rows]), y[rows]).backward()
    opt.step()
    opt.zero_grad()
    return opt


def _dsd_round_trip(out: str) -> dict:
    """Stock DSD get_state_dict -> dcp.save -> dcp.load -> set_state_dict, model + Adam, same W."""
    model = _sharded(_llama())
    opt = _adam_step(model)
    msd, osd = get_state_dict(model, opt)
    types = {k: type(v).__name__ for k, v in osd["state"]["layers.0.attention.wq.weight"].items()}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "dsd"))
    fresh = _sharded(_llama(seed=3))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "dsd"))
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    mismatched = [name for (name, p), q in zip(model.named_parameters(), fresh.parameters())
                  if not torch.equal(p, q) or opt.state[p].keys() != fresh_opt.state[q].keys()
                  or not all(torch.equal(v, fresh_opt.state[q][k]) for k, v in opt.state[p].items())]
    return {"dsd_types": types, "dsd_mismatched": mismatched, "dsd_lr": fresh_opt.param_groups[0]["lr"],
            "dsd_optim": gather_full_optimizer_state(model, opt), "dsd_params": get_full_state_dict(model)}


def _dsd_full_loads(rank: int) -> dict:
    """A plain model's full model and Adam state dicts into flashfsdp with DSD's full_state_dict=True."""
    plain = _llama(seed=4)
    plain_opt = _adam_step(plain, lr=3e-3, seed=1, whole_batch=True)  # the same state on every rank
    full_osd = get_optimizer_state_dict(plain, plain_opt)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    flash = _sharded(_llama(seed=5))
    flash_opt = torch.optim.Adam(flash.parameters(), lr=0.5)
    set_model_state_dict(flash, plain.state_dict() if rank == 0 else {}, options=broadcast)
    set_optimizer_state_dict(flash, flash_opt, full_osd if rank == 0 else {}, options=broadcast)
    mismatched = []
    for (name, q), p in zip(flash.named_parameters(), plain.parameters()):
        for key, want in plain_opt.state[p].items():
            got = flash_opt.state[q][key]
            if want.dim():  # a DTensor of the parameter's placements holding this rank's dim-0 chunk
                ok = (isinstance(got, DTensor) and got.placements == q.placements
                      and torch.equal(got.to_local(), torch.chunk(want, dist.get_world_size(), 0)[dist.get_rank()]))
            else:
                ok = torch.equal(got, want)
            if not ok:
                mismatched.append(f"{name}.{key}")
    return {"full_load_mismatched": mismatched, "full_load_lr": flash_opt.param_groups[0]["lr"],
            "full_load_model": get_full_state_dict(flash), "full_load_want": plain.state_dict()}


def _save_to_rank0_file(sd: dict, path: str) -> None:
    if dist.get_rank() == 0:
        torch.save(sd, path)
    dist.barrier()


def _saved_and_loaded(sd: dict) -> dict:
    """``sd`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    saved = io.BytesIO()
    torch.save(sd, saved)
    return torch.load(io.BytesIO(saved.getvalue()), weights_only=True)


def _sharded_values(rank: int, model) -> dict:
    """What model.state_dict()'s DTensors are: placements, local chunks, ``torch.save``-able
    (``weights_only``), loadable when given with other placements; and what loading them into an
    unwrapped module does, next to FSDP2's."""
    sd = model.state_dict()
    dtensors = {k: v for k, v in sd.items() if isinstance(v, DTensor)}
    want = _llama().state_dict()
    res = {"placements": {tuple(v.placements) for v in dtensors.values()},
           "chunks_differ": [k for k, v in dtensors.items()
                             if not torch.equal(v.to_local(), torch.chunk(want[k], 2, 0)[rank])],
           "requires_grad": [k for k, v in sd.items() if v.requires_grad]}
    back = _saved_and_loaded(sd)
    res["save_load_differ"] = [k for k, v in dtensors.items()
                               if type(back[k]) is not DTensor or back[k].placements != v.placements
                               or not torch.equal(back[k].to_local(), v.to_local())]
    # DTensors of other placements are redistributed into the unit's (here: replicated values)
    other = _sharded(_llama(seed=3))
    other.load_state_dict({k: v.redistribute(placements=[Replicate()]) if isinstance(v, DTensor) else v
                           for k, v in sd.items()})
    res["from_replicated"] = get_full_state_dict(other)
    try:  # a sharded value in a full state dict (checked on rank 0, raised on every rank)
        set_full_state_dict(other, {**want, "norm.weight": sd["norm.weight"]} if rank == 0 else None)
        res["sharded_into_full"] = None
    except TypeError as exc:
        res["sharded_into_full"] = str(exc)
    # a sharded state dict into an unwrapped module: torch's own error, as with FSDP2's
    errors = {}
    for name, sharded_sd in (("flashfsdp", sd), ("fsdp2", _fsdp2(seed=0).state_dict())):
        try:
            _llama().load_state_dict(sharded_sd)
            errors[name] = None
        except RuntimeError as exc:
            errors[name] = type(exc).__name__
    res["into_unwrapped"] = errors
    return res


def _optimizer_reload(rank: int) -> dict:
    """Optimizer.state_dict() / load_state_dict through torch.save once stepped: DTensor state of
    the parameters' placements, reloaded into stepped and never-stepped optimizers; and a state
    dict of full-shape plain tensors, which is not cut into chunks (as with FSDP2: the step fails)."""
    model = _sharded(_llama())
    opt = _adam_step(model)
    first = next(iter(model.parameters()))
    sd = opt.state_dict()
    exp_avg = sd["state"][0]["exp_avg"]
    res = {"exp_avg": (type(exp_avg).__name__, tuple(exp_avg.placements), exp_avg.shape == first.shape,
                       sd["state"][0]["step"].dim())}
    loaded = _saved_and_loaded(sd)
    fresh = _sharded(_llama(seed=2))
    res["reloaded_differ"] = []
    for fresh_opt in (_adam_step(fresh, lr=0.5), torch.optim.Adam(fresh.parameters(), lr=0.5)):
        fresh_opt.load_state_dict(loaded)
        fresh_opt.step()  # no gradients: nothing moves
        res["reloaded_lr"] = fresh_opt.param_groups[0]["lr"]
        for p, q in zip(model.parameters(), fresh.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                got, want = fresh_opt.state[q][key], opt.state[p][key]
                if type(got) is not type(want) or not torch.equal(got.to_local() if want.dim() else got,
                                                                  want.to_local() if want.dim() else want):
                    res["reloaded_differ"].append(key)
    # full-shape plain state (e.g. of an unsharded model's optimizer) given to load_state_dict
    full = {**sd, "state": {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in st.items()}
                            for i, st in sd["state"].items()}}
    res["full_shape_step"] = {}
    for name, target in (("flashfsdp", _sharded(_llama(seed=2))), ("fsdp2", _fsdp2(seed=2))):
        target_opt = _adam_step(target, lr=0.5)
        target_opt.load_state_dict(full)
        _adam_step_with(target, target_opt)
        try:
            target_opt.step()
            res["full_shape_step"][name] = None
        except RuntimeError as exc:
            res["full_shape_step"][name] = type(exc).__name__
    return res


def _adam_step_with(model, opt) -> None:
    """Gradients of one batch for ``model`` (this rank's rows), for ``opt`` to step."""
    x, y = make_batch("llama", 1, 4)
    rows = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    loss_fn("llama", model(x[rows]), y[rows]).backward()


def _state_dicts(rank, world_size, out):
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    res = {}
    model = _sharded(_llama())
    sd = model.state_dict()
    res["keys"] = list(sd)
    res["types"] = {k: type(v).__name__ for k, v in sd.items()}
    res["values"] = _sharded_values(rank, model)
    res["optimizer"] = _optimizer_reload(rank)
    res["dsd_keys"] = list(get_model_state_dict(model))
    res["full"] = get_full_state_dict(model)
    res["full_everywhere"] = get_full_state_dict(model, cpu_offload=False, rank0_only=False)
    # sharded checkpoint of model.state_dict(); loaded at W = 2 here and at W = 1 by the test
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(out, "sharded"))
    other = _sharded(_llama(seed=3))
    other_sd = other.state_dict()
    dcp.load(other_sd, checkpoint_id=os.path.join(out, "sharded"))
    set_model_state_dict(other, other_sd)
    res["reloaded"] = get_full_state_dict(other)
    # after training
    res["trained"] = train_flashfsdp("llama", rank, world_size, steps=3, full_state_dict=True)["full_state_dict"]
    # full checkpoint: flashfsdp -> file -> FSDP2
    _save_to_rank0_file(res["full"], os.path.join(out, "flash_full.pt"))
    fsdp2 = _fsdp2(seed=4)
    loaded = torch.load(os.path.join(out, "flash_full.pt")) if rank == 0 else {}
    set_model_state_dict(fsdp2, loaded, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    res["fsdp2_from_flash"] = get_model_state_dict(fsdp2, options=full_options)
    # full checkpoint: FSDP2 -> file -> flashfsdp
    fsdp2 = _fsdp2(seed=5)
    res["fsdp2_full"] = get_model_state_dict(fsdp2, options=full_options)
    _save_to_rank0_file(res["fsdp2_full"], os.path.join(out, "fsdp2_full.pt"))
    flash = _sharded(_llama(seed=6))
    set_full_state_dict(flash, torch.load(os.path.join(out, "fsdp2_full.pt")) if rank == 0 else None)
    res["flash_from_fsdp2"] = get_full_state_dict(flash)
    # sharded DCP checkpoints: FSDP2's loads into flashfsdp, flashfsdp's into FSDP2
    dcp.save(fsdp2.state_dict(), checkpoint_id=os.path.join(out, "fsdp2_sharded"))
    flash = _sharded(_llama(seed=7))
    flash_sd = flash.state_dict()
    dcp.load(flash_sd, checkpoint_id=os.path.join(out, "fsdp2_sharded"))
    flash.load_state_dict(flash_sd)
    res["flash_from_fsdp2_dcp"] = get_full_state_dict(flash)
    fsdp2 = _fsdp2(seed=8)
    fsdp2_sd = fsdp2.state_dict()
    dcp.load(fsdp2_sd, checkpoint_id=os.path.join(out, "sharded"))
    fsdp2.load_state_dict(fsdp2_sd)
    res["fsdp2_from_flash_dcp"] = get_model_state_dict(fsdp2, options=full_options)
    res.update(_dsd_round_trip(out))
    res.update(_dsd_full_loads(rank))
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("state_dicts"))
    return out, run_distributed(_state_dicts, 2, out)


def test_sharded_and_full_state_dicts_at_w2(results):
    _, (r0, r1) = results
    want = _llama().state_dict()
    for r in (r0, r1):
        assert r["keys"] == list(want) and r["dsd_keys"] == list(want)
        assert r["types"]["output.weight"] == r["types"]["tok_embeddings.weight"] == "DTensor"
        assert r["types"]["norm.calibration"] == "Tensor"  # buffers stay plain, replicated
        values = r["values"]
        assert values["placements"] == {(Shard(0),)}  # FSDP2's, each holding this rank's torch.chunk rows
        assert "'norm.weight' must be a full (unsharded) tensor, got DTensor" in values["sharded_into_full"]
        assert values["sharded_into_full"].endswith("(rank 0)")
        assert values["chunks_differ"] == [] and values["requires_grad"] == []  # detached
        assert values["save_load_differ"] == []  # torch.save'd, read back with weights_only=True
        # a sharded state dict does not load into an unwrapped module: torch's error, as FSDP2's
        assert values["into_unwrapped"] == {"flashfsdp": "RuntimeError", "fsdp2": "RuntimeError"}
        _assert_same(r["full_everywhere"], want)
    _assert_same(r0["full"], want)  # exactly equal right after init, same keys and order
    _assert_same(r0["values"]["from_replicated"], want)  # loaded from DTensors of other placements
    _assert_same(r0["reloaded"], want)
    assert r1["full"] == {} and r1["reloaded"] == {} and r1["trained"] == {}
    ref = train_reference("llama", 2, steps=3, state_dict=True)
    _assert_same(r0["trained"], ref["state_dict"], **FP32_PARAMS)
    # a fresh unwrapped model loads it strictly and computes what the reference computes
    plain, trained_ref = make_llama(seed=11), make_llama(seed=12)
    plain.load_state_dict(r0["trained"], strict=True)
    trained_ref.load_state_dict(ref["state_dict"], strict=True)
    x, _ = make_batch("llama", 0, 4)
    torch.testing.assert_close(plain(x), trained_ref(x), **FP32_PARAMS)


def test_full_and_sharded_checkpoints_round_trip_with_fsdp2(results):
    _, (r0, _) = results
    _assert_same(r0["fsdp2_from_flash"], r0["full"])
    _assert_same(r0["flash_from_fsdp2"], r0["fsdp2_full"])
    _assert_same(r0["flash_from_fsdp2_dcp"], r0["fsdp2_full"])
    _assert_same(r0["fsdp2_from_flash_dcp"], r0["full"])


def test_sharded_checkpoint_of_w2_loads_at_w1(results):
    out, _ = results
    with use_backend("reference"):
        model = _sharded(_llama(seed=9))
        sd = model.state_dict()
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(sd, checkpoint_id=os.path.join(out, "sharded"), no_dist=True)
        model.load_state_dict(sd)
        _assert_same(get_full_state_dict(model), _llama().state_dict())
    # the buffer (replicated) is in the checkpoint once: one key, one chunk, one storage entry
    metadata = dcp.FileSystemReader(os.path.join(out, "sharded")).read_metadata()
    assert [k for k in metadata.state_dict_metadata if "calibration" in k] == ["norm.calibration"]
    assert len(metadata.state_dict_metadata["norm.calibration"].chunks) == 1
    assert [k.fqn for k in metadata.storage_data if "calibration" in k.fqn] == ["norm.calibration"]


def test_stock_dsd_get_and_set_state_dict_with_optimizer(results):
    """get_state_dict + dcp.save / dcp.load + set_state_dict: same W exactly, and resharded to W = 1."""
    out, (r0, r1) = results
    for r in (r0, r1):
        assert r["dsd_types"] == {"step": "Tensor", "exp_avg": "DTensor", "exp_avg_sq": "DTensor"}
        assert r["dsd_mismatched"] == [] and r["dsd_lr"] == 1e-2
    want = r0["dsd_optim"]  # every parameter's Adam state assembled from the two ranks' chunks
    with use_backend("reference"):
        model = _sharded(_llama(seed=9))
        opt = torch.optim.Adam(model.parameters(), lr=0.5)
        msd, osd = get_state_dict(model, opt)
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "dsd"), no_dist=True)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        _assert_same(get_full_state_dict(model), r0["dsd_params"])
        assert opt.param_groups[0]["lr"] == 1e-2
        for name, p in model.named_parameters():
            assert opt.state[p].keys() == want[name].keys(), name
            for key, value in want[name].items():
                torch.testing.assert_close(opt.state[p][key], value.reshape(opt.state[p][key].shape), **EXACT)


def test_stock_dsd_full_state_dict_loads(results):
    _, (r0, r1) = results
    for r in (r0, r1):
        assert r["full_load_mismatched"] == [] and r["full_load_lr"] == 3e-3
    _assert_same(r0["full_load_model"], r0["full_load_want"])


def _dsd_full_getters(rank, world_size):
    """DSD's full getters on a flashfsdp model: what flashfsdp's own gathering gives, by key."""
    model = _sharded(_llama())
    opt = _adam_step(model)
    full_cpu = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=full_cpu)
    return {"model": msd, "optim": osd["state"] if osd else {},
            "model_all_ranks": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
            "optim_all_ranks": get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)),
            "want_model": get_full_state_dict(model, rank0_only=False),
            "want_optim": gather_full_optimizer_state(model, opt)}


def test_stock_dsd_full_state_dict_getters_gather_flashfsdp_models():
    """FSDP2 code exports with DSD's full getters: they must give full tensors, not this rank's chunks."""
    r0, r1 = run_distributed(_dsd_full_getters, 2)
    assert r1["model"] == {} and r1["optim"] == {}  # cpu_offload: rank 0 keeps them, as with FSDP2
    for r, model_sd, optim in ((r0, r0["model"], r0["optim"]), (r1, r1["model_all_ranks"], None),
                               (r0, r0["model_all_ranks"], r0["optim_all_ranks"]["state"])):
        _assert_same(model_sd, r["want_model"])
        assert all(type(v) is torch.Tensor for v in model_sd.values())
        if optim is not None:
            assert optim.keys() == r["want_optim"].keys()
            for name, entries in r["want_optim"].items():
                for key, want in entries.items():
                    torch.testing.assert_close(optim[name][key], want, **EXACT)


def test_optimizer_state_dicts_hold_dtensors_and_reload(results):
    """The stepped optimizer's state_dict() holds DTensors of the parameters' placements, which
    torch.save / torch.load(weights_only=True) and load_state_dict carry into stepped and
    never-stepped optimizers. A state dict of full-shape plain tensors is loaded as it is, no
    longer cut into this rank's part: as with FSDP2, the next step then fails."""
    _, (r0, r1) = results
    for r in (r0, r1):
        opt = r["optimizer"]
        assert opt["exp_avg"] == ("DTensor", (Shard(0),), True, 0)
        assert opt["reloaded_differ"] == [] and opt["reloaded_lr"] == 1e-2
        assert opt["full_shape_step"] == {"flashfsdp": "RuntimeError", "fsdp2": "RuntimeError"}


class _WithExtraState(torch.nn.Module):
    def get_extra_state(self):
        return {"calibrated": True}

    def set_extra_state(self, state):
        pass


def test_bad_input_is_named():
    with use_backend("reference"):
        model = _sharded(_llama())
        good = _llama().state_dict()
        with pytest.raises(TypeError, match="get_full_state_dict: model must be an nn.Module"):
            get_full_state_dict(good)
        with pytest.raises(ValueError, match="has no fully_shard'ed module"):
            get_full_state_dict(_llama())
        with pytest.raises(TypeError, match="cpu_offload must be a bool"):
            get_full_state_dict(model, cpu_offload="yes")
        with pytest.raises(ValueError, match="state_dict has no entry for 'layers.1.attention.wk.weight'"):
            set_full_state_dict(model, {k: v for k, v in good.items() if k != "layers.1.attention.wk.weight"})
        with pytest.raises(ValueError, match=r"'norm.weight' has shape \(3,\) in state_dict but \(32,\) in the model"):
            set_full_state_dict(model, {**good, "norm.weight": torch.ones(3)})
        with pytest.raises(ValueError, match=r"unexpected key\(s\) \['extra.weight'\]"):
            set_full_state_dict(model, {**good, "extra.weight": torch.ones(3)})
        with pytest.raises(TypeError, match="state_dict must be a mapping"):
            set_full_state_dict(model, None)
        set_full_state_dict(model, {k: v for k, v in good.items() if k != "norm.weight"}, strict=False)
        with pytest.raises(ValueError, match=r"'layers.0.attention.wq.weight' has shape \(32, 31\), but the "
                                             r"parameter's full shape is \(32, 32\)"):
            model.load_state_dict({**good, "layers.0.attention.wq.weight": torch.zeros(32, 31)})
        model.load_state_dict(dict(good), assign=True)  # FSDP2 accepts it: taken back into the flat shards
        assert torch.equal(get_full_state_dict(model, rank0_only=False)["norm.weight"], good["norm.weight"])
        sharded = {id(p) for m in model.modules() if "_flashfsdp_state" in m.__dict__
                   for g in m._flashfsdp_state.unit.groups for p in g.sharded_params}
        assert all(id(p) in sharded for p in model.parameters())  # the units' own sharded parameters
        opt = torch.optim.Adam(model.parameters())
        with pytest.raises(TypeError, match="get_optimizer_state_dict: optimizer must be a torch.optim.Optimizer"):
            flashfsdp.get_optimizer_state_dict(model, "adam")
        with pytest.raises(ValueError, match="must have 'state' and 'param_groups'"):
            flashfsdp.set_optimizer_state_dict(model, opt, {"state": {}})
        with_extra = _llama()
        with_extra.extra = _WithExtraState()
        _sharded(with_extra)
        with pytest.raises(NotImplementedError, match="'extra._extra_state' is module extra state"):
            set_full_state_dict(with_extra, {**good, "extra._extra_state": {"calibrated": True}})
        # one process without torch.distributed: the state dict holds plain full tensors, which an
        # unwrapped module loads (at W = 2, DTensors: see test_sharded_and_full_state_dicts_at_w2)
        unwrapped = _llama(seed=5)
        unwrapped.load_state_dict(model.state_dict())
        _assert_same(unwrapped.state_dict(), get_full_state_dict(model))
        # plain full tensors are accepted where sharded values are expected, and loaded exactly
        model.load_state_dict(good)
        _assert_same(get_full_state_dict(model), good)


def test_optimizer_state_dict_round_trip_at_w1_is_plain():
    with use_backend("reference"):
        model = _sharded(_llama())
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = make_batch("llama", 0, 2)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1)).backward()
        opt.step()
        osd = flashfsdp.get_optimizer_state_dict(model, opt)
        entry = osd["state"]["layers.0.attention.wq.weight"]
        # one process without torch.distributed: no mesh, plain full-shape state
        assert type(entry["exp_avg"]) is torch.Tensor and entry["exp_avg"].shape == (32, 32)
        assert entry["step"].dim() == 0
        assert all(type(v) is torch.Tensor for s in opt.state.values() for v in s.values())
        fresh = _sharded(_llama(seed=2))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=5e-3)
        flashfsdp.set_optimizer_state_dict(fresh, fresh_opt, osd)
        assert fresh_opt.param_groups[0]["lr"] == 1e-3
        for p, q in zip(model.parameters(), fresh.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(fresh_opt.state[q][key], opt.state[p][key], **EXACT)


def test_optimizer_state_dict_of_a_stepped_optimizer_reloads_at_w1():
    """Plain Optimizer.state_dict() / load_state_dict (through torch.save) once the optimizer stepped,
    into a stepped and a never-stepped optimizer (one process: plain full-shape state)."""
    with use_backend("reference"):
        model = _sharded(_llama())
        opt = _adam_step(model)
        first = next(iter(model.parameters()))
        sd = opt.state_dict()
        assert type(sd["state"][0]["exp_avg"]) is torch.Tensor and sd["state"][0]["step"].dim() == 0
        assert sd["state"][0]["exp_avg"].shape == first.shape
        loaded = _saved_and_loaded(sd)
        fresh = _sharded(_llama(seed=2))
        for fresh_opt in (_adam_step(fresh, lr=0.5), torch.optim.Adam(fresh.parameters(), lr=0.5)):
            fresh_opt.load_state_dict(loaded)
            fresh_opt.step()  # no gradients: nothing moves
            assert fresh_opt.param_groups[0]["lr"] == 1e-2
            for p, q in zip(model.parameters(), fresh.parameters()):
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert type(fresh_opt.state[q][key]) is torch.Tensor
                    torch.testing.assert_close(fresh_opt.state[q][key], opt.state[p][key], **EXACT)
        plain_opt = _adam_step(_llama())  # an optimizer over plain parameters
        assert type(plain_opt.state_dict()["state"][0]["exp_avg"]) is torch.Tensor


def test_full_state_dict_is_in_the_master_dtype_under_bf16_compute():
    with use_backend("reference"):
        model = _llama()
        policy = flashfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for unit in llama_units(model):
            flashfsdp.fully_shard(unit, mp_policy=policy)
        x, _ = make_batch("llama", 0, 2)
        model(x).float().sum().backward()  # the unsharded bf16 buffers have been used and freed
        _assert_same(get_full_state_dict(model), _llama().state_dict())  # fp32, exactly the init values
        _assert_same(get_full_state_dict(model, cpu_offload=False, rank0_only=False), _llama().state_dict())
