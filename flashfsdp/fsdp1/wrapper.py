"""``FullyShardedDataParallel``: FSDP1's wrapper API over ``fully_shard`` units (no second engine).

``FullyShardedDataParallel(module, ...)`` wraps ``module`` as FSDP1 does (the wrapper holds it as
``_fsdp_wrapped_module``; ``.module`` returns it), after auto-wrapping its submodules bottom-up
(``wrap.py``), preparing it (``module_init.py``) and making it one ``fully_shard`` unit over the
mesh its sharding strategy needs (``sharding.py``). Everything at run time is the unit's:
unshard, reshard, prefetch, reduce-scatter.

[Note: FSDP1 parameters]
Outside forward/backward each original parameter is this rank's 1-D piece of it, named as FSDP1
names it with ``use_orig_params=True`` (``_fsdp_wrapped_module.`` before each wrapped module's
names), whatever ``use_orig_params`` says: FSDP1's ``use_orig_params=False`` instead shows one
``_flat_param`` per wrapper, which flat units do not expose (an optimizer over
``model.parameters()`` steps the same values either way; per-parameter groups, which FSDP1 only
allows with ``use_orig_params=True``, work too). ``use_orig_params=False`` keeps FSDP1's
restriction of ``summon_full_params(with_grads=True)``. Inside ``summon_full_params`` the names
lose the ``_fsdp_wrapped_module.`` segments, as in FSDP1.

[Note: FSDP1 prefetching]
``forward_prefetch=False`` (FSDP1's default): a unit is all-gathered when its forward starts;
True: the next unit's all-gather is issued when a unit's forward starts (the runtime's implicit
forward prefetch). ``backward_prefetch`` BACKWARD_PRE / BACKWARD_POST: the previous unit's
all-gather is issued when a unit's backward starts (the runtime's implicit backward prefetch,
for both; the runtime issues it before the gradient computation); None: none.
``limit_all_gathers=True``: at most two units prefetched ahead of compute (the runtime's default);
False: no limit but the number of units.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn

from flashfsdp.bindings import clip_grad_norm_ as sharded_clip_grad_norm_, fully_shard
from flashfsdp.runtime.tree import cast_floating

from . import api, module_init, optim as optim_sd, sharding, state_dict_type as sdt, summon, wrap
from .api import BackwardPrefetch, ShardingStrategy, StateDictType


class FullyShardedDataParallel(nn.Module):
    """FSDP1's wrapper: shards ``module``'s parameters across ranks (one unit per wrapper).

    Args (FSDP1's, see torch.distributed.fsdp.FullyShardedDataParallel):
        module: the module to wrap (its parameters on one device, or on meta).
        process_group: the group to shard over (None: the default group); for hybrid
            strategies the pair ``(intra_node_group, inter_node_group)``.
        sharding_strategy: a ``ShardingStrategy`` (None: FULL_SHARD); see ``sharding.py``.
        cpu_offload: ``CPUOffload(offload_params=True)``: shards, gradients and optimizer steps
            on the CPU.
        auto_wrap_policy: torch's ``ModuleWrapPolicy`` / ``CustomPolicy`` / policy callables
            (``functools.partial`` forms) or a set of module classes (``wrap.py``).
        backward_prefetch, forward_prefetch, limit_all_gathers: [Note: FSDP1 prefetching].
        mixed_precision: a ``MixedPrecision`` (see [Note: FSDP1 mixed precision] in ``api.py``).
        ignored_modules / ignored_states: modules (with their submodules) or parameters left as
            they are (not sharded, gradients not reduced).
        param_init_fn: called on each module of a unit on the meta device (else
            ``reset_parameters()`` after ``to_empty``).
        device_id: the device (an int: a CUDA index) the module is moved to and computes on.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        use_orig_params: see [Note: FSDP1 parameters].
        device_mesh: a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid strategies.

    Raises:
        TypeError / ValueError / NotImplementedError: bad arguments, each naming the argument (see
            the functions of ``api.py``, ``sharding.py``, ``wrap.py``, ``module_init.py``, and
            ``fully_shard``).
    """

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy: ShardingStrategy | None = None,
                 cpu_offload=None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE, mixed_precision=None,
                 ignored_modules: Iterable[nn.Module] | None = None, param_init_fn: Callable | None = None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True, use_orig_params: bool = False,
                 ignored_states=None, device_mesh=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel: module must be an nn.Module, got {type(module).__name__}")
        strategy = api.check_sharding_strategy(sharding_strategy)
        api.check_backward_prefetch(backward_prefetch)
        mp_policy = api.mp_policy_of(mixed_precision)
        offload = api.offload_policy_of(cpu_offload)
        ignored, ignored_params = module_init.ignored_states(module, ignored_modules, ignored_states)
        device = module_init.resolve_device_id(device_id)
        plan = sharding.resolve(strategy, process_group, device_mesh, _device_type(module, device))
        if auto_wrap_policy is not None:
            policy = wrap.as_policy(auto_wrap_policy)
            kwargs = dict(process_group=process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                          backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                          param_init_fn=param_init_fn, device_id=device_id, sync_module_states=sync_module_states,
                          forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                          use_orig_params=use_orig_params, ignored_states=ignored_params or None,
                          device_mesh=device_mesh)
            targets = wrap.wrap_targets(module, policy, ignored, ignored_params, kwargs)
            wrap.check_targets(module, policy, targets, FullyShardedDataParallel)
            wrap.auto_wrap(module, targets, FullyShardedDataParallel)
        modules = module_init.unit_modules(module, ignored, FullyShardedDataParallel)
        module_init.materialize(modules, ignored_params, param_init_fn, device or _default_device(), sync_module_states)
        module_init.move_to(modules, device)
        if sync_module_states:
            module_init.sync_module_states(modules, ignored_params, plan.sync_groups)
        cast = module_init.cast_buffers(modules, getattr(mixed_precision, "buffer_dtype", None))
        names = {id(m): path for path, m in module.named_modules()}
        self._fsdp_buffer_dtypes = {f"{names[mid]}.{n}" if names[mid] else n: d for (mid, n), d in cast.items()}
        self._fsdp_sharding_strategy = strategy
        self._fsdp_mixed_precision = mixed_precision
        self._fsdp_use_orig_params = bool(use_orig_params)
        self._fsdp_limit_all_gathers = bool(limit_all_gathers)
        self._fsdp_is_root: bool | None = None  # decided at the first forward, or by an enclosing wrapper
        self._fsdp_state_dict_settings = sdt.default_settings()
        fully_shard(module, mesh=plan.mesh, reshard_after_forward=api.RESHARD_AFTER_FORWARD[strategy],
                    mp_policy=mp_policy, offload_policy=offload, ignored_params=ignored_params)
        self._fsdp_wrapped_module = module
        _configure_unit(module, forward_prefetch, backward_prefetch)
        for inner in FullyShardedDataParallel.fsdp_modules(module):
            inner._fsdp_is_root = False
        sdt.install_hooks(self)

    # ------------------------------------------------------------------ module protocol
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module (as in FSDP1)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self._modules.get("_fsdp_wrapped_module")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; the root first casts the inputs and sets root-only
        settings (see [Note: FSDP1 prefetching])."""
        if self._fsdp_is_root is None:
            self._fsdp_is_root = True
            self._configure_root()
        dtype = api.input_dtype(self._fsdp_mixed_precision, bool(self._fsdp_is_root))
        if dtype is not None:
            args, kwargs = cast_floating((args, kwargs), dtype)
        with torch.autograd.profiler.record_function("FullyShardedDataParallel.forward"):
            return self._fsdp_wrapped_module(*args, **kwargs)

    def _configure_root(self) -> None:
        """FSDP1 keeps the root's parameters after forward (its backward starts right away)."""
        inner = self._fsdp_wrapped_module
        inner.set_reshard_after_forward(False, recurse=False)
        if not self._fsdp_limit_all_gathers:
            inner.set_max_inflight_all_gathers(max(2, len(FullyShardedDataParallel.fsdp_modules(self))))

    def check_is_root(self) -> bool:
        """Whether this wrapper is a root (no enclosing wrapper)."""
        return self._fsdp_is_root is not False

    def _check_root(self, where: str) -> None:
        if not self.check_is_root():
            raise RuntimeError(f"{where} should only be called on the root FSDP instance (the outermost "
                               f"FullyShardedDataParallel), not on a nested one")

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``; inside ``summon_full_params`` without the
        ``_fsdp_wrapped_module.`` segments (as FSDP1)."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield (sdt.clean_key(name) if summon.summoning() else name), param

    def named_buffers(self, *args, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``; inside ``summon_full_params`` without the segments."""
        for name, buf in super().named_buffers(*args, **kwargs):
            yield (sdt.clean_key(name) if summon.summoning() else name), buf

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with this unit's full parameters summoned (and written back), as
        FSDP1 does for initialisation: ``fn`` sees (and may change) the full parameters."""
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            super().apply(fn)
        return self

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self):
        """Inside: gradients accumulate without communication (every unit); the first backward
        after it reduces everything accumulated. Call it on the root.

        Raises:
            RuntimeError: called on a nested wrapper.
        """
        self._check_root("no_sync()")
        inner = self._fsdp_wrapped_module
        inner.set_requires_gradient_sync(False, recurse=True)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True, recurse=True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the norm of all gradients across ranks; returns that norm
        (``flashfsdp.clip_grad_norm_``). Call it on the root.

        Raises:
            RuntimeError: called on a nested wrapper.
            ValueError: ``max_norm`` <= 0 or ``norm_type`` <= 0.
        """
        self._check_root("clip_grad_norm_()")
        return sharded_clip_grad_norm_(self, max_norm, norm_type)

    # ------------------------------------------------------------------ static API
    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every wrapper in ``module`` (itself included), or only the roots with ``root_only``."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        return [m for m in found if m.check_is_root()] if root_only else found

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False):
        """Inside: the full parameters of every wrapper in ``module`` (``recurse``) or of
        ``module`` only; ``writeback``: changes persist. Collective. See ``summon.py``.

        Raises:
            RuntimeError: inside forward/backward.
            NotImplementedError: FSDP1's unsupported combinations (``summon.check_args``); a
                tensor-subclass parameter with FSDP2's all-gather extensions (``summon.summon_state``).
        """
        wrappers = FullyShardedDataParallel.fsdp_modules(module) if recurse else (
            [module] if isinstance(module, FullyShardedDataParallel) else [])
        with contextlib.ExitStack() as stack:
            for w in wrappers:
                summon.check_args(w, writeback, rank0_only, offload_to_cpu, with_grads)
                stack.enter_context(summon.summon_state(w._fsdp_wrapped_module._flashfsdp_state, writeback,
                                                        rank0_only, offload_to_cpu, with_grads))
            yield

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                            optim_state_dict_config=None):
        """Set the state-dict type of every wrapper in ``module``; returns the previous settings.

        Raises:
            NotImplementedError: LOCAL_STATE_DICT; TypeError: mismatched configs (``make_settings``).
            ValueError: ``module`` holds no wrapper.
        """
        settings = sdt.make_settings(state_dict_type, state_dict_config, optim_state_dict_config)
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        for w in FullyShardedDataParallel.fsdp_modules(module):
            w._fsdp_state_dict_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module):
        """The ``StateDictSettings`` of the wrappers in ``module``.

        Raises:
            ValueError: no wrapper, or wrappers with different settings.
        """
        found = [w._fsdp_state_dict_settings for w in FullyShardedDataParallel.fsdp_modules(module)]
        if not found or any(s != found[0] for s in found):
            raise ValueError(f"get_state_dict_type: {type(module).__name__} holds "
                             f"{'no FullyShardedDataParallel' if not found else 'wrappers with different settings'}")
        return found[0]

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                        optim_state_dict_config=None):
        """Inside: ``state_dict()`` / ``load_state_dict()`` / ``optim_state_dict`` of every
        wrapper in ``module`` use this type (see ``state_dict_type.py``)."""
        previous = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                                optim_state_dict_config)
        try:
            yield
        finally:
            for w in FullyShardedDataParallel.fsdp_modules(module):
                w._fsdp_state_dict_settings = previous

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The state dict of ``state_dict_type`` (FULL_STATE_DICT by default), with the unwrapped
        model's keys (see ``state_dict_type.py``). Collective."""
        if sdt.effective(self).state_dict_type is StateDictType.FULL_STATE_DICT and not sdt.in_raw():
            return sdt.full_state_dict(self, destination, prefix)
        return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict=None, group=None):
        """The optimizer's state keyed by parameter names, full or sharded as the model's
        ``state_dict_type`` says (``optim.py``). Collective.

        Raises:
            NotImplementedError: ``optim_state_dict`` or ``group`` given (the optimizer's own
                state and the model's groups are used).
        """
        if optim_state_dict is not None or group is not None:
            raise NotImplementedError("optim_state_dict: pass only model and optim; the optimizer's own state and "
                                      "the model's process groups are used")
        return optim_sd.optim_state_dict(model, optim, FullyShardedDataParallel)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict,
                                 is_named_optimizer: bool = False, load_directly: bool = False, group=None):
        """``optim_state_dict`` as ``optim.load_state_dict`` takes it (loaded at once with
        ``load_directly``); see ``optim.py``.

        Raises:
            NotImplementedError: ``is_named_optimizer`` or ``group``.
        """
        if is_named_optimizer or group is not None:
            raise NotImplementedError("optim_state_dict_to_load: is_named_optimizer and group are not supported")
        result = optim_sd.optim_state_dict_to_load(model, optim, optim_state_dict, FullyShardedDataParallel)
        if load_directly:
            optim.load_state_dict(result)
        return result


def _configure_unit(module: nn.Module, forward_prefetch: bool, backward_prefetch) -> None:
    """The unit's prefetch settings (see [Note: FSDP1 prefetching])."""
    if not forward_prefetch:
        module.set_modules_to_forward_prefetch([])
    if backward_prefetch is None:
        module.set_modules_to_backward_prefetch([])


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device_type(module: nn.Module, device: torch.device | None) -> str:
    """The device type of the unit's mesh: ``device_id``'s, else the parameters' (meta: the default's)."""
    if device is not None:
        return device.type
    for p in module.parameters():
        if not p.is_meta:
            return p.device.type
    return _default_device().type
