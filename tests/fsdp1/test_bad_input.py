"""Bad input to flashfsdp's FullyShardedDataParallel: each raises a clear error naming the argument
(upstream: the ``assertRaisesRegex`` cases of ``test_fsdp_misc.py``, ``test_wrap.py``,
``test_fsdp_summon_full_params.py``, ``test_fsdp_state_dict.py``). flashfsdp only: the messages
are its own, and torch's FSDP1 accepts some of these (a policy that wraps nothing)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import wrap as policies
from torch.distributed.tensor import DTensor

from tests.fsdp1_suite.common import FSDP, Block, api, batch, make_net, wrap
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)
OWN = "the messages are flashfsdp's"


@cases.case(torch_reason=OWN)
def strategy_needs_a_2d_mesh(rank, world_size, impl):
    strategy = api(impl).ShardingStrategy
    with pytest.raises(ValueError, match="needs a 2-D device_mesh"):
        wrap(impl, make_net(), sharding_strategy=strategy.HYBRID_SHARD)
    with pytest.raises(ValueError, match="needs a 2-D device_mesh"):
        wrap(impl, make_net(), sharding_strategy=strategy._HYBRID_SHARD_ZERO2,
             device_mesh=init_device_mesh("cpu", (world_size,)))
    with pytest.raises(ValueError, match="is for HYBRID_SHARD"):
        wrap(impl, make_net(), process_group=(dist.group.WORLD, dist.group.WORLD))
    with pytest.raises(ValueError, match="either process_group or device_mesh"):
        wrap(impl, make_net(), process_group=dist.group.WORLD, device_mesh=init_device_mesh("cpu", (world_size,)))
    return {}


@cases.case(torch_reason=OWN)
def policy_wraps_nothing(rank, world_size, impl):
    with pytest.raises(ValueError, match=r"auto_wrap_policy wraps \['Conv2d'\].*would wrap nothing"):
        wrap(impl, make_net(), auto_wrap_policy=policies.ModuleWrapPolicy({nn.Conv2d}))
    with pytest.raises(ValueError, match="would wrap nothing"):
        wrap(impl, make_net(), auto_wrap_policy=functools.partial(policies.transformer_auto_wrap_policy,
                                                                   transformer_layer_cls={nn.Conv2d}))
    with pytest.warns(UserWarning, match="selected no submodule"):
        wrap(impl, make_net(), auto_wrap_policy=functools.partial(policies.size_based_auto_wrap_policy,
                                                                   min_num_params=10**9))
    return {}


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block(16)
        self.again = nn.Sequential(self.first)

    def forward(self, x):
        return self.again(self.first(x))


@cases.case(torch_reason=OWN)
def policy_wraps_a_module_twice(rank, world_size, impl):
    with pytest.raises(ValueError, match="shared by.*wrapped twice"):
        wrap(impl, _Shared(), auto_wrap_policy={Block})
    model = make_net()
    model.blocks[0] = wrap(impl, model.blocks[0])
    with pytest.raises(ValueError, match="would wrap 'blocks.0' a second time"):
        wrap(impl, model, auto_wrap_policy={Block})
    return {}


@cases.case(torch_reason=OWN)
def meta_modules_that_stay_on_meta(rank, world_size, impl):
    with torch.device("meta"):
        model = make_net()
    with pytest.raises(ValueError, match="still on the meta device.*sync_module_states=True has no values"):
        wrap(impl, model, sync_module_states=True, param_init_fn=lambda m: None)
    with torch.device("meta"):
        bare = nn.Sequential(nn.Linear(4, 4), nn.Bilinear(4, 4, 4))
        bare.add_module("extra", nn.Module())
        bare.extra.weight = nn.Parameter(torch.empty(3))
    with pytest.raises(ValueError, match="Module is on the meta device and has no reset_parameters"):
        wrap(impl, bare, sync_module_states=True)
    return {}


class _SummonsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.owner = nn.Linear(4, 4), []

    def forward(self, x):
        with self.owner[0].summon_full_params(self.owner[0]):
            return self.lin(x)


@cases.case(torch_reason=OWN)
def summon_inside_forward_or_backward(rank, world_size, impl):
    inner = _SummonsInForward()
    fsdp_model = wrap(impl, inner)
    inner.owner.append(fsdp_model)
    with pytest.raises(RuntimeError, match="summon full parameters during forward/backward"):
        fsdp_model(torch.randn(2, 4))
    other = wrap(impl, make_net())
    out = other(batch(0, rank, world_size)[0])
    out.register_hook(lambda g: FSDP(impl).summon_full_params(other).__enter__())
    with pytest.raises(RuntimeError, match="during forward/backward"):
        out.sum().backward()
    return {}


@cases.case(torch_reason=OWN)
def state_dict_types_it_cannot_give(rank, world_size, impl):
    fsdp_model, cls, sd_type = wrap(impl, make_net()), FSDP(impl), api(impl).StateDictType
    with pytest.raises(NotImplementedError, match="LOCAL_STATE_DICT is not supported"):
        cls.set_state_dict_type(fsdp_model, sd_type.LOCAL_STATE_DICT)
    with pytest.raises(TypeError, match="takes a FullStateDictConfig, got ShardedStateDictConfig"):
        cls.set_state_dict_type(fsdp_model, sd_type.FULL_STATE_DICT, api(impl).ShardedStateDictConfig())
    # _use_dtensor=True is what SHARDED_STATE_DICT gives anyway now (DTensor values), so it is taken
    cls.set_state_dict_type(fsdp_model, sd_type.SHARDED_STATE_DICT, api(impl).ShardedStateDictConfig(_use_dtensor=True))
    params = dict(fsdp_model.named_parameters())
    values = {k: v for k, v in fsdp_model.state_dict().items() if k in {n.replace("_fsdp_wrapped_module.", "") for n in params}}
    assert values and all(type(v) is DTensor for v in values.values()), {k: type(v) for k, v in values.items()}
    return {}


@cases.case(torch_reason=OWN)
def summon_combinations_fsdp1_refuses(rank, world_size, impl):
    fsdp_model, cls = wrap(impl, make_net()), FSDP(impl)
    with pytest.raises(NotImplementedError, match="writeback=True and rank0_only=True"):
        cls.summon_full_params(fsdp_model, rank0_only=True).__enter__()
    with pytest.raises(NotImplementedError, match="with_grads=True needs use_orig_params=True"):
        cls.summon_full_params(fsdp_model, with_grads=True).__enter__()
    return {}


@cases.case(torch_reason=OWN)
def bad_arguments(rank, world_size, impl):
    fsdp1 = api(impl)
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads=True"):
        wrap(impl, make_net(), mixed_precision=fsdp1.MixedPrecision(torch.float16, keep_low_precision_grads=True))
    with pytest.raises(TypeError, match="mixed_precision must be a MixedPrecision"):
        wrap(impl, make_net(), mixed_precision=torch.distributed.fsdp.MixedPrecisionPolicy(torch.float16))
    with pytest.raises(TypeError, match="cpu_offload must be a CPUOffload"):
        wrap(impl, make_net(), cpu_offload=True)
    with pytest.raises(TypeError, match="sharding_strategy must be a ShardingStrategy"):
        wrap(impl, make_net(), sharding_strategy="FULL_SHARD")
    with pytest.raises(TypeError, match="backward_prefetch must be a BackwardPrefetch"):
        wrap(impl, make_net(), backward_prefetch="BACKWARD_PRE")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device_id=0 names a CUDA device, but CUDA is not available"):
            wrap(impl, make_net(), device_id=0)
    model = make_net()
    with pytest.raises(ValueError, match="ignored_modules or ignored_states, not both"):
        wrap(impl, model, ignored_modules=[model.head], ignored_states=[model.inp])
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        wrap(impl, make_net(), auto_wrap_policy=42)
    return {}


@cases.case(torch_reason=OWN)
def root_only_methods_on_a_nested_wrapper(rank, world_size, impl):
    fsdp_model = wrap(impl, make_net(), auto_wrap_policy={Block})
    nested = FSDP(impl).fsdp_modules(fsdp_model)[1]
    with pytest.raises(RuntimeError, match=r"no_sync\(\) should only be called on the root"):
        nested.no_sync().__enter__()
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) should only be called on the root"):
        nested.clip_grad_norm_(1.0)
    return {}


test_case = cases.pytest_tests()
