"""torch.compile on fully_shard'ed models: per-block (``block.compile()`` and ``torch.compile(block)``)
and whole-model compile train to the eager losses at W = 2, with the units' hooks kept out of the
compiled graphs (see [Note: compiling sharded modules] in ``flashfsdp/bindings/compile_boundary.py``).

Every case runs in one spawn of two gloo ranks, each against the same model trained eagerly: a
tiny Llama with ``block.compile()`` through ``aot_eager`` (Dynamo and AOTAutograd, no code
generation); a small MLP stack through ``aot_eager`` compiled the other two ways, and through the
default backend (inductor) with ``block.compile()``; a stack of 18 MLP blocks, each compiled,
past Dynamo's recompile limit (8): ``fully_shard`` gives every block of one class the same
``FSDP<Class>`` type, as torch does, so the blocks share one graph — with a class per instance
each block recompiled and blocks 9 and on ran eagerly without a word. Tracing and code generation
are the slow parts on a shared CPU: the small MLP blocks keep them to seconds.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

STEPS = 3
FP32 = dict(rtol=1e-5, atol=1e-5)


class CountingBackend:
    """A torch.compile backend delegating to ``name`` that counts the graphs it compiled and the
    calls of their compiled forwards (so a test sees that compiled code ran, and what was captured)."""

    def __init__(self, name: str):
        from torch._dynamo.backends.registry import lookup_backend  # noqa: PLC0415

        self.inner, self.graphs, self.calls = lookup_backend(name), [], 0

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


def _train(kind: str, model, rank: int, world_size: int) -> list[float]:
    """STEPS AdamW steps on this rank's rows; the global-mean losses. From the second step on, a
    recompilation raises (``fail_on_recompile``): the hooks' bookkeeping must not change guards."""
    kind = "mlp" if kind == "deep" else kind
    import torch.distributed as dist  # noqa: PLC0415

    from tests.models import loss_fn, make_batch  # noqa: PLC0415
    from tests.training import local_rows  # noqa: PLC0415

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = (local_rows(t, rank, world_size) for t in make_batch(kind, step, 2 * world_size))
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            loss = loss_fn(kind, model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    total = torch.stack(losses)
    dist.all_reduce(total)
    return (total / world_size).tolist()


DEEP_BLOCKS = 18  # past torch._dynamo.config.recompile_limit (8)


def _sharded(kind: str):
    import flashfsdp  # noqa: PLC0415
    from tests.models import MLPStack  # noqa: PLC0415
    from tests.training import make_model, units_of  # noqa: PLC0415

    if kind == "deep":
        torch.manual_seed(0)
        model = MLPStack(n_blocks=DEEP_BLOCKS)
        kind = "mlp"
    else:
        model = make_model(kind)
    for unit in units_of(kind, model):
        flashfsdp.fully_shard(unit)
    return model


def _blocks(kind: str, model):
    return model.layers if kind == "llama" else model.blocks


def _compiled(kind: str, how: str, backend):
    """A sharded model compiled ``how``: "method" (``block.compile()``), "function"
    (``torch.compile(block)`` put in the block's place) or "whole" (``torch.compile(model)``);
    and its number of blocks."""
    model = _sharded(kind)
    blocks = _blocks(kind, model)
    count = len(blocks)
    if how == "method":
        for block in blocks:
            block.compile(backend=backend)
    elif how == "function":
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, backend=backend)
    else:
        model = torch.compile(model, backend=backend)
    return model, count


def _all_ways(rank: int, world_size: int) -> dict:
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    inductor_config.compile_threads = 1  # no pool of compile workers for one small graph
    results = {}
    for kind, ways in (("llama", [("method", "aot_eager")]),
                       ("mlp", [("function", "aot_eager"), ("whole", "aot_eager"), ("method", "inductor")]),
                       ("deep", [("method", "aot_eager")])):
        results[kind, "eager"] = {"losses": _train(kind, _sharded(kind), rank, world_size)}
        for how, name in ways:
            torch._dynamo.reset()  # each model's graphs compiled afresh
            backend = CountingBackend(name)
            model, blocks = _compiled(kind, how, backend)
            losses = _train(kind, model, rank, world_size)
            results[kind, how] = {"losses": losses, "graphs": len(backend.graphs), "calls": backend.calls,
                                  "blocks": blocks}
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_ways, 2, timeout=280)


@pytest.mark.parametrize("kind, how", [("llama", "method"), ("mlp", "function"), ("deep", "method")])
def test_per_block_compile_trains_to_the_eager_losses(runs, kind, how):
    for rank in runs:
        got = rank[kind, how]
        torch.testing.assert_close(got["losses"], rank[kind, "eager"]["losses"], **FP32)
        # The blocks (one class, one FSDP<Class>) share their graphs, the hooks in none of them (a
        # traced hook would break it in pieces): at most one graph per block, far fewer than the
        # blocks, and every block's compiled forward called at every step without recompiling —
        # none fell back to eager after hitting the recompile limit.
        assert 1 <= got["graphs"] <= 2, got["graphs"]
        assert got["calls"] == got["blocks"] * STEPS


def test_whole_model_compile_trains_to_the_eager_losses(runs):
    for rank in runs:
        got = rank["mlp", "whole"]
        torch.testing.assert_close(got["losses"], rank["mlp", "eager"]["losses"], **FP32)
        # Dynamo breaks the graph at each unit's hooks: the blocks (one graph for all three, one
        # class) and the stretches of the root's forward between them are compiled graphs; every
        # block's runs at every step, none recompiled.
        assert got["graphs"] >= 2, got
        assert got["calls"] >= (got["blocks"] + 1) * STEPS, got


def test_per_block_inductor_compile_trains_to_the_eager_losses(runs):
    for rank in runs:
        got = rank["mlp", "method"]
        torch.testing.assert_close(got["losses"], rank["mlp", "eager"]["losses"], **FP32)
        assert 1 <= got["graphs"] <= 2 and got["calls"] == got["blocks"] * STEPS


def test_one_fsdp_class_per_original_class():
    """``fully_shard`` caches ``FSDP<Class>`` per class (torch's ``cls_to_fsdp_cls``): two blocks
    share their type, which subclasses torch's ``FSDPModule``."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415
    from tests.models import MLPBlock  # noqa: PLC0415

    a, b = MLPBlock(3, 5), MLPBlock(3, 5)
    flashfsdp.fully_shard(a)
    flashfsdp.fully_shard(b)
    assert type(a) is type(b) and type(a).__name__ == "FSDPMLPBlock"
    assert isinstance(a, FSDPModule) and isinstance(a, flashfsdp.FSDPModule) and isinstance(a, MLPBlock)


def test_hooks_stay_unwrapped():
    """The forward hooks are marked, not wrapped: eager calls cost what they did without compile."""
    from flashfsdp.bindings import compile_boundary  # noqa: PLC0415
    from flashfsdp.bindings.state import FSDPState  # noqa: PLC0415

    assert compile_boundary.frame_skipping_available()
    for hook in (FSDPState._pre_forward, FSDPState._post_forward):
        assert hook._torchdynamo_disable is True
        assert not hasattr(hook, "_torchdynamo_orig_callable")  # torch.compiler.disable's wrapper


def test_run_eagerly_refuses_a_non_function():
    from flashfsdp.bindings.compile_boundary import run_eagerly  # noqa: PLC0415

    with pytest.raises(TypeError, match="run_eagerly: expected a Python function, got Linear"):
        run_eagerly(torch.nn.Linear(2, 2))
