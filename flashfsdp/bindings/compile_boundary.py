"""Keeping each unit's hooks out of torch.compile: they run eagerly, between the compiled graphs.

[Note: compiling sharded modules]
``block.compile()`` compiles ``Module._call_impl``, hooks included, and ``torch.compile(block)``
calls the module (``__call__``) inside the compiled region; either way Dynamo would trace the
unit's forward hooks and, through them, the runtime's host-side planning (numpy segment tables,
the prefetch policy, collectives on a communicator), which it cannot capture. So the forward hooks
(``FSDPState._pre_forward`` / ``_post_forward``) are marked with :func:`run_eagerly`: Dynamo
breaks the graph at the hook's call and runs it, and everything it calls, as plain Python. A
compiled block is thus one graph between its pre-forward and post-forward hooks, and a compiled
model (``torch.compile(model)``) one graph per stretch between two units' hooks. The backward
hooks (tensor hooks, post-accumulate-grad hooks, the engine's final callback) run in the
autograd engine, outside any compiled region. FSDP2 keeps its hooks out the same way
(``torch.distributed.fsdp._fully_shard._fsdp_state``: ``_pre_forward`` / ``_post_forward`` under
``_dynamo_disable``, which wraps them in ``torch._dynamo.disable`` at every call).

Eager cost: none. ``torch.compiler.disable`` would put a wrapper around the hook (about 0.5 µs
per call on a CPU core: it swaps Dynamo's frame callback out and back); instead the function keeps
its code and is only marked: its ``_torchdynamo_disable`` attribute makes Dynamo's tracer refuse to
inline it (the graph break), and its code object's frame-execution strategy (SKIP for the frame
and, recursively, for every frame it calls) makes Dynamo's frame callback leave it alone when it
then runs. Both are read by torch only while a compiled region runs. A torch without that
strategy API gets the ``torch.compiler.disable`` wrapper instead (the same behaviour, the
wrapper's cost).
"""

from __future__ import annotations

from typing import Callable

import torch

from flashfsdp._torch_private import FrameAction, FrameExecStrategy, set_code_exec_strategy


def _frame_skipper() -> Callable[[object], None] | None:
    """A function that makes Dynamo skip a code object and every frame it calls, or None on a
    torch without the frame-execution strategy API (private, see ``flashfsdp._torch_private``)."""
    if None in (set_code_exec_strategy, FrameExecStrategy, FrameAction):
        return None
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    return lambda code: set_code_exec_strategy(code, strategy)


_skip_frames = _frame_skipper()


def run_eagerly(function: Callable) -> Callable:
    """Keep ``function`` and everything it calls out of torch.compile's graphs, at no eager cost.

    See [Note: compiling sharded modules]. Use it on a plain function (the one stored on the
    class, outermost decorator): Dynamo breaks the graph where a compiled region calls it, and runs
    it eagerly. Its code object is marked, so every function sharing that code (other methods
    made by the same decorator) is skipped when it runs as a frame of its own too.

    Args:
        function: a Python function.

    Returns:
        ``function`` itself, marked; on a torch without the frame-execution strategy API,
        ``torch.compiler.disable(function)``.

    Raises:
        TypeError: ``function`` is not a Python function (no code object to mark).
    """
    code = getattr(function, "__code__", None)
    if code is None:
        raise TypeError(f"run_eagerly: expected a Python function, got {type(function).__name__} ({function!r})")
    if _skip_frames is None:
        return torch.compiler.disable(function, recursive=True)
    _skip_frames(code)
    function._torchdynamo_disable = True  # Dynamo's tracer: do not inline, break the graph here
    return function


def frame_skipping_available() -> bool:
    """Whether this torch lets :func:`run_eagerly` mark functions (no wrapper, no eager cost)."""
    return _skip_frames is not None
