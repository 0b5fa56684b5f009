"""How a unit learns that its backward starts and that it is done — without touching activations.

- **Pre-backward**: a tensor hook (``Tensor.register_hook``) on every forward output that requires
  grad. It fires when the gradient of that output arrives, i.e. before the unit's own backward;
  there the unit unshards again. FSDP2 does the same (``_register_pre_backward_hook``).
- **Post-backward**: a :class:`PostBackwardGate` per unit, with two events per backward pass:

  1. *gradients ready*: every trainable unsharded parameter that this backward reaches has its
     gradient accumulated (``register_post_accumulate_grad_hook``; which ones the backward
     reaches is asked of the autograd engine, ``torch._C._will_engine_execute_node``, as
     ``register_multi_grad_hook`` does). The unit reduce-scatters then, so the reduction reads
     complete gradients even when a parameter is used by an op that does not depend on the
     unit's inputs, or by several forwards of the unit.
  2. *done*: gradients ready, and the gradients of the forward inputs that required grad
     computed (``torch.autograd.graph.register_multi_grad_hook``), so no op of the unit that may
     still read a parameter (a frozen one, whose gradient is never accumulated) runs after the
     unit reshards. Units without trainable parameters are done when their inputs are. A unit
     with a frozen parameter whose forward had no input to wait for (none required grad, or
     only leaves did: the root of a model whose embedding is frozen) is done at the end of the
     backward, as FSDP2 ends it then: an op that reads the frozen parameter to pass a gradient to
     an earlier unit (the frozen base weight of a LoRA output head) may run after the unit's
     trainable parameters have their gradients.

  A unit whose events do not come (no input requires grad and no parameter gets a gradient; an
  output that the loss does not use) is finished by the final callback queued on the autograd
  engine.

[Note: why no autograd.Function]
An identity ``autograd.Function`` applied to the outputs or inputs (FSDP2's
``RegisterPostBackwardFunction``, and this module before) returns its inputs as-is, which makes
them views created in a custom Function: any in-place op on them (``h = block(x); h += x``, or an
in-place op on an input inside the unit) then raises. Hooks leave every activation as it was.
The gate keeps no activation alive: the input hooks live on the graph, the gate only counts them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterable

import torch
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

from flashfsdp import _torch_private

from flashfsdp.runtime.tree import tensors_in


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (jvp, vmap, grad) is running: it builds no autograd
    nodes to hook, and its own transform handles the derivatives (FSDP2 skips its hooks too)."""
    return _torch_private.are_functorch_transforms_active()


def outside_functorch():
    """A context in which the runtime's own tensor work (copy-in, collectives, frees) runs on plain
    tensors even inside a functorch transform (its buffers are not part of what is transformed)."""
    return _torch_private.DisableFuncTorch() if functorch_active() else contextlib.nullcontext()


def grad_tensors(tree) -> list[torch.Tensor]:
    """The tensors in ``tree`` that require grad (none when grad mode is off or a functorch
    transform runs)."""
    if not torch.is_grad_enabled() or functorch_active():
        return []
    return [t for t in tensors_in(tree) if t.requires_grad]


def register_pre_backward_hooks(hook: Callable[[], None], tree, hooked_leaves: dict) -> None:
    """Call ``hook()`` when the gradient of any tensor in ``tree`` that requires grad arrives.

    A hook on a non-leaf tensor lives on its graph and goes with it; it is never removed by hand,
    since that graph's backward may come after other backwards (FSDP2 does the same). A leaf
    (a parameter or input the unit returns as is) outlives its graphs, so it is hooked once:
    ``hooked_leaves`` (id -> weak reference, the caller's) remembers which.
    """

    def on_grad(grad):
        hook()
        return None

    for t in grad_tensors(tree):
        if t.grad_fn is None:
            ref = hooked_leaves.get(id(t))
            if ref is not None and ref() is t:
                continue
            if len(hooked_leaves) > 1024:
                for key in [k for k, r in hooked_leaves.items() if r() is None]:
                    del hooked_leaves[key]
            hooked_leaves[id(t)] = weakref.ref(t)
        t.register_hook(on_grad)


def queue_final_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (autograd engine callback queue)."""
    Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (e.g. recomputation)."""
    return _torch_private.current_graph_task_id() != -1


def current_backward() -> int:
    """The id of the backward pass (autograd graph task) running on this thread, -1 if none."""
    return _torch_private.current_graph_task_id()


def _will_accumulate(node) -> bool:
    """Whether this backward runs the AccumulateGrad ``node`` (``torch.autograd.grad`` never does;
    the engine refuses to be asked about leaves then)."""
    try:
        return _torch_private.will_engine_execute_node(node)
    except RuntimeError:
        return False


class PostBackwardGate:
    """The post-backward events of one unit (module docstring).

    Args:
        on_grads_ready: called once per backward pass when every trainable parameter it reaches
            has its gradient accumulated (reduce them).
        on_done: called once per backward pass after ``on_grads_ready`` (or without it, for a unit
            with no trainable parameter reached) when the armed inputs' gradients are computed too
            (reshard).

    Use: :meth:`track_params` with the unit's unsharded parameters (again whenever which of them
    require grad changes); :meth:`arm` with each forward's inputs that require grad (:meth:`wait_for_inputs`
    for a unit with a frozen parameter); :meth:`reset`
    when the backward is over; :meth:`forget_inputs` when a forward had no backward.
    """

    # Input hooks remembered at most (forwards without backward in a row would otherwise pile up).
    MAX_ARMED = 1024

    def __init__(self, on_grads_ready: Callable[[], None], on_done: Callable[[], None]):
        self._on_grads_ready = on_grads_ready
        self._on_done = on_done
        self._nodes: list = []  # AccumulateGrad nodes of the trainable unsharded parameters
        self._hooked: set[int] = set()
        self._param_handles: list[RemovableHandle] = []
        self._input_handles: list[tuple[int, RemovableHandle]] = []
        self._pending: set[int] = set()  # armed input hooks that have not fired yet
        self._next_id = 0
        self._task = -2
        self._waiting_params = 0
        self._ready = False
        self._done = False
        self._hold = False  # done only at the end of the backward (see wait_for_inputs)

    def track_params(self, params: Iterable[torch.Tensor]) -> bool:
        """Watch the gradient accumulation of those ``params`` that require grad; False (nothing
        done, call again later) inside a functorch transform, where autograd nodes are not built."""
        if functorch_active():
            return False
        trainable = [p for p in params if p.requires_grad]
        # The nodes are kept alive here, so the graph reuses them (a parameter's AccumulateGrad
        # node is otherwise cached weakly and may be recreated).
        self._nodes = [get_gradient_edge(p).node for p in trainable]
        for p in trainable:
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._param_handles.append(p.register_post_accumulate_grad_hook(self._on_param))
        return True

    def arm(self, tensors: list[torch.Tensor]) -> None:
        """Wait also for the gradients of ``tensors`` (a forward's inputs) before ``on_done``.

        Not during a backward pass (activation recomputation): a recomputed graph is either
        backpropagated in a nested pass of its own (reentrant checkpointing), where the gradients
        of the parameters mark the unit's end, or never (non-reentrant checkpointing). Leaf
        inputs are left out: nothing of the unit runs after their gradient is computed but its
        accumulation, and ``torch.autograd.grad`` cannot be asked about leaves.
        """
        tensors = [t for t in tensors if t.grad_fn is not None]
        if not tensors or in_backward() or functorch_active():
            return
        entry = self._next_id
        self._next_id += 1
        self._pending.add(entry)
        handle = register_multi_grad_hook(tensors, lambda grads: self._on_inputs(entry), mode="all")
        self._input_handles.append((entry, handle))
        if len(self._input_handles) > self.MAX_ARMED:
            old, old_handle = self._input_handles.pop(0)
            old_handle.remove()
            self._pending.discard(old)

    def wait_for_inputs(self, tensors: list[torch.Tensor]) -> None:
        """For a unit with a frozen parameter: :meth:`arm` with ``tensors``; if none of them can be
        armed in a forward that builds a graph (no non-leaf input requires grad), ``on_done``
        waits for the end of the backward instead (the final callback ends the unit then)."""
        armed = self._next_id
        self.arm(tensors)
        if self._next_id == armed and torch.is_grad_enabled() and not in_backward() and not functorch_active():
            self._hold = True

    def forget_inputs(self) -> None:
        """Stop waiting for the inputs armed so far (their forward is over and had no backward)."""
        self._pending.clear()
        self._hold = False

    def reset(self) -> None:
        """The backward pass is over: drop the input hooks and the counts."""
        for _, handle in self._input_handles:
            handle.remove()
        self._input_handles = []
        self._pending.clear()
        self._hold = False
        self._task = -2

    def _begin(self) -> None:
        task = current_backward()
        if task == self._task:
            return
        self._task = task
        self._waiting_params = sum(1 for n in self._nodes if _will_accumulate(n))
        self._ready = self._waiting_params == 0
        self._done = False

    def _on_param(self, param: torch.Tensor) -> None:
        self._begin()
        self._waiting_params -= 1
        if self._waiting_params == 0 and not self._ready:
            self._ready = True
            self._on_grads_ready()
            self._maybe_done()

    def _on_inputs(self, entry: int) -> None:
        self._begin()
        self._pending.discard(entry)
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self._ready and not self._pending and not self._done and not self._hold:
            self._done = True
            self._on_done()
