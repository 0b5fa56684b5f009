"""torchtitan's pipeline parallelism (``pipeline_parallel_degree = 2``) over flashfsdp, against FSDP2.

torchtitan's own ``pipeline_llm`` splits the llama3 debug model into stages
(``_pipeline_module_split``), applies its ``parallelize_llama`` to each (``fully_shard`` per block,
on the embedding, on [norm, output] and on the stage, with ``reshard_after_forward=False`` as its
"default" policy sets under pipeline parallelism) and builds the schedule
(``_build_pipeline_schedule``: ``scale_grads=False``, its loss returning ``(loss, extra)``); a
``(pp, dp_shard) = (2, 2)`` mesh at W = 4 on gloo. Each step runs the schedule with its
token-normalised loss (``global_valid_tokens`` through ``loss_kwargs``, as its trainer passes
it), torchtitan's ``clip_grad_norm_`` over the pipeline mesh and its AdamW container. The losses
(the last stage's, per data-parallel rank), the norms and the parameters equal the unsharded
model's trained on both data-parallel ranks' batches, and flashfsdp's equal torch's FSDP2's.

The CPU adaptations of ``test_torchtitan.py`` apply (device type "cpu", SDPA attention, SUM
reductions under the divide factor 1.0 torchtitan sets). The swap: ``torchtitan.distributed.fsdp.fully_shard``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.clients.common import assert_close_tree, local
from tests.harness import run_distributed

pytest.importorskip("torchtitan", reason="torchtitan: pip install -e .[titan]")

from tests.clients.test_torchtitan import _debug_model, _swapped  # noqa: E402

W, PP, DP, SEQ, BATCH, MAX_NORM = 4, 2, 2, 32, 2, 1.0
TOL = dict(rtol=1e-5, atol=1e-6)


def _pipeline(spec, model, api, schedule: str, loss_fn):
    """torchtitan's ``pipeline_llm`` with ``api.fully_shard``: (schedule, model parts, has first
    stage, has last stage, pp mesh)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: PLC0415
    from torchtitan.distributed import ParallelDims  # noqa: PLC0415
    from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: PLC0415

    parallelism = ParallelismConfig(pipeline_parallel_degree=PP, data_parallel_shard_degree=DP,
                                    pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=1,
                                    spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
    with _swapped("torchtitan.distributed.parallel_dims", "device_type", "cpu"), \
            _swapped("torchtitan.distributed.fsdp", "fully_shard", api.fully_shard):
        dims = ParallelDims.from_config(parallelism, W)
        dims.build_mesh()
        pipe, parts, has_first, has_last = pipeline_llm(
            model, parallel_dims=dims, training=training, parallelism=parallelism, compile_config=CompileConfig(),
            ac_config=None, dump_folder="", device=torch.device("cpu"), model_config=spec.model,
            parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn)
    for part in parts:
        for m in part.modules():
            if isinstance(m, torch.distributed.fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return pipe, parts, has_first, has_last, dims.get_mesh("pp"), dims.get_mesh("fsdp")


def _titan_pp_training(api, rank: int, schedule: str, steps: int = 2) -> dict:
    from torchtitan.components.loss import CrossEntropyLoss  # noqa: PLC0415
    from torchtitan.components.optimizer import default_adamw  # noqa: PLC0415
    from torchtitan.distributed import utils as dist_utils  # noqa: PLC0415

    spec, model = _debug_model()
    ref = copy.deepcopy(model)
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=2048).build()
    pipe, parts, has_first, has_last, pp_mesh, dp_mesh = _pipeline(spec, model, api, schedule, loss_fn)
    for part in parts:
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in part.parameters())
    optimizers = default_adamw(lr=8e-4).build(model_parts=parts)
    ref_opt = default_adamw(lr=8e-4).build(model_parts=[ref])
    dp_rank = dp_mesh.get_local_rank()
    out = {"losses": [], "norms": []}
    for step in range(steps):
        batches = []
        for d in range(DP):
            tokens = torch.randint(2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + 10 * step + d))
            batches.append((tokens[:, :-1], tokens[:, 1:]))
        global_valid_tokens = torch.tensor(float(BATCH * SEQ * DP))
        inputs, labels = batches[dp_rank]
        losses: list[torch.Tensor] = []
        pipe.step(*((inputs,) if has_first else ()), target=labels if has_last else None,
                  losses=losses if has_last else None, loss_kwargs={"global_valid_tokens": global_valid_tokens},
                  return_outputs=False)
        ref_losses = []
        for ref_inputs, ref_labels in batches:
            ref_loss, _ = loss_fn(ref(ref_inputs), ref_labels, global_valid_tokens)
            ref_loss.backward()
            ref_losses.append(ref_loss.detach())
        if has_last:
            loss = torch.stack(losses).sum()
            torch.testing.assert_close(loss, ref_losses[dp_rank], **TOL)
            out["losses"].append(loss)
        params = [p for part in parts for p in part.parameters()]
        norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, foreach=True)
        torch.testing.assert_close(norm, ref_norm, rtol=2e-4, atol=0)
        out["norms"].append(norm)
        for o in (optimizers, ref_opt):
            o.step()
            o.zero_grad()
    out["params"] = {}
    for part in parts:
        for name, p in part.named_parameters():
            full = p.full_tensor().detach()
            torch.testing.assert_close(full, ref.get_parameter(name).detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name} after {steps} steps: {m}")
            out["params"][name] = local(p).clone()
    return out


def _case(rank, world_size, impl, schedule):
    from torch.distributed import fsdp  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415

    want = _titan_pp_training(fsdp, rank, schedule)
    if impl == "flashfsdp":
        got = _titan_pp_training(flashfsdp, rank, schedule)
        assert_close_tree(got, want, "flashfsdp against torch's FSDP2", **TOL)
    return want["losses"]


@pytest.mark.slow  # two 6.2M-parameter pipelines (torch's, flashfsdp's) and the unsharded model on 4 ranks
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize("impl", ["torch", "flashfsdp"])
def test_torchtitan_pipeline_parallel(impl, schedule):
    """torchtitan's ``pipeline_llm`` at ``pipeline_parallel_degree = 2``, ``data_parallel_shard_degree
    = 2``: the stages' losses, torchtitan's gradient norms and the parameters after two steps equal
    the unsharded model's, and flashfsdp's equal FSDP2's."""
    assert dist.is_available()
    run_distributed(_case, W, impl, schedule, timeout=600)
