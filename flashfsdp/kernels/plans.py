"""Launch plans: :func:`flatten` / :func:`unflatten` over a fixed list of tensors, called again and again.

A unit's copy-out moves the same chunks into the same unsharded views at every unshard; only the
flat buffer is new. The ops validate every tensor and build their segment table on each call,
a host cost of about a microsecond per tensor, which for a unit of many small tensors outweighs
the GPU work. A plan keeps what the first call learned and checks, on each later call, only
what it depends on:

- the flat buffer: dtype, shape, strides, device and its address modulo 16 (the table's
  ALIGNED_FLAG depends on it), and, where its address moved, that no tensor's bytes reach into
  its bytes (the op's aliasing check, by binary search over the tensors' byte ranges sorted at
  the build; a buffer that overlaps one is checked again in full);
- each tensor's ``data_ptr()``, in one pass compared with the kept list (a tensor given new
  storage, e.g. by ``set_`` or a storage freed and re-allocated elsewhere, is a new address);
- on CUDA, the current stream (the kept device table is ordered on the stream it was uploaded on).

Anything different: the plan validates again exactly as the op does (same exceptions, same
messages) and builds a new table, never launching a stale one. Where the dispatcher picks the
reference (CPU without the interpreter, a float64 tensor, ``use_backend("reference")``), a run is
the reference op itself; with non-contiguous tensors (whose staging copies move every call) it is
the op's launcher after the one validation.

[Note: launch plan contract] A plan holds its tensors (the objects, not copies) and keeps, per
tensor, only its address: the caller must not change a tensor's dtype, shape, strides or device
in place while its address stays the same (``as_strided_``, ``resize_`` within the storage,
``t.data = t.data.view(...)``); a tensor moved to other memory is detected.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Sequence

import torch

from flashfsdp.kernels import reference
from flashfsdp.kernels.dispatch import op_backend
from flashfsdp.kernels.flatten import flatten_table, flatten_validated, launch_flatten
from flashfsdp.kernels.segments import ALIGNMENT_BYTES, DTYPE_CODES
from flashfsdp.kernels.unflatten import launch_unflatten, unflatten_table, unflatten_validated
from flashfsdp.kernels.validation import ScannedItems, check_scale, validate_flatten, validate_unflatten

_FLOAT64_CODE = DTYPE_CODES[torch.float64]


class _LaunchPlan:
    """What one validated call of a multi-tensor op left for the next calls (see the module
    docstring): the flat buffer's signature, the tensors' addresses and byte ranges, the table."""

    def __init__(self, tensors: Sequence[torch.Tensor | None], offsets: Sequence[int]):
        self._tensors = list(tensors)
        self._offsets = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
        self._live = [t for t in self._tensors if t is not None]
        self._float64 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in self._live)
        self.builds = 0  # validations + tables built (the first run, then one per change detected)
        self._forget()

    def _forget(self) -> None:
        self._signature = self._addresses = self._prepared = None
        self._flat_address, self._starts, self._reach = 0, [], []

    @staticmethod
    def _signature_of(flat: object) -> tuple | None:
        if not isinstance(flat, torch.Tensor):
            return None
        stream = torch.cuda.current_stream(flat.device).cuda_stream if flat.is_cuda else 0
        return flat.dtype, flat.shape, flat.stride(), flat.device, flat.data_ptr() % ALIGNMENT_BYTES, stream

    def is_current(self, flat: object) -> bool:
        """Whether a run on ``flat`` (any object) would launch the kept table as it is: a table is
        kept and serves ``flat`` and the tensors as they are now (O(1) checks of ``flat``, a binary
        search where its address moved, one pass over the tensors' addresses). This is all the
        host work of a run before its launch; it raises nothing."""
        if self._signature is None or self._signature_of(flat) != self._signature:
            return False
        address = flat.data_ptr()
        if address != self._flat_address:
            # the tensors' byte ranges that start before the buffer ends: does any reach into it?
            k = bisect.bisect_left(self._starts, address + flat.numel() * flat.element_size())
            if k and self._reach[k - 1] > address:
                return False  # may alias a tensor now: the op's full check decides
        if list(map(torch.Tensor.data_ptr, self._live)) != self._addresses:
            return False
        self._flat_address = address  # known not to alias the tensors at their kept addresses
        return True

    def _keep(self, flat: torch.Tensor, items: ScannedItems, prepared: tuple[torch.Tensor, int] | None) -> None:
        """Keep ``prepared`` (the table built for ``flat`` and ``items``) and what it depends on."""
        kept = [(t, a) for t, a in zip(self._tensors, items.addresses) if t is not None]
        spans = sorted((a, a + t.numel() * t.element_size()) for t, a in kept if t.numel())
        self._starts = [start for start, _ in spans]
        self._reach = list(itertools.accumulate((end for _, end in spans), max))  # ends' running max
        self._addresses = [a for _, a in kept]
        self._flat_address = flat.data_ptr()
        self._signature = self._signature_of(flat)
        self._prepared = prepared

    def _kept(self, flat: torch.Tensor, offsets: list[int], items: ScannedItems) -> bool:
        """After a validation: count a build, note whether a float64 tensor appeared, and keep the
        table (True) unless none can be kept (False: a non-contiguous tensor, whose staging copy
        moves every call; a float64 one, which runs the reference)."""
        self.builds += 1
        self._forget()
        self._float64 = _FLOAT64_CODE in items.codes
        if items.noncontiguous or self._float64:
            return False
        self._keep(flat, items, self._table_of(flat, offsets, items))
        return True

    def _table_of(self, flat: torch.Tensor, offsets: list[int],
                  items: ScannedItems) -> tuple[torch.Tensor, int] | None:
        """The op launcher's segment table of a validated call (``None``: nothing to launch)."""
        raise NotImplementedError


class UnflattenPlan(_LaunchPlan):
    """:func:`flashfsdp.kernels.unflatten` from any flat buffer into fixed outputs, its launch
    prepared once.

    ``plan.run(flat)`` does what ``unflatten(flat, offsets, outs)`` does, with the same errors;
    on the Triton path, after the first run, it checks ``flat`` in O(1) and the outputs'
    addresses in one pass, and launches the kept segment table (the module docstring; the caller
    keeps [Note: launch plan contract]).

    Args:
        offsets: element offset of each output's range in the flat buffer (ints).
        outs: tensors of any shape, float32/bfloat16/float16/float64, written by each run; the
            plan keeps the list (a copy of it: later changes to the caller's list are not seen).

    Attributes:
        builds: how many times a run (or :meth:`prepare`) validated and built a table (1
            after the first run on the Triton path, then one more per change detected; 0 on
            the reference).
    """

    def __init__(self, offsets: Sequence[int], outs: Sequence[torch.Tensor]):
        super().__init__(outs, offsets)

    def run(self, flat: torch.Tensor) -> None:
        """Copy ``flat``'s ranges into the outputs, with cast: ``outs[i].view(-1)[:] =
        flat[offsets[i] : offsets[i] + outs[i].numel()].to(outs[i].dtype)``.

        Args:
            flat: 1-D contiguous float32/bfloat16/float16/float64 buffer on the outputs' device
                (any buffer each call; a new address, size or dtype is checked in full).

        Raises:
            TypeError, ValueError, RuntimeError: as :func:`flashfsdp.kernels.unflatten`, with
                its messages.
        """
        if not isinstance(flat, torch.Tensor) or op_backend(
                "unflatten", flat, float64=self._float64) == "reference":
            reference.unflatten(flat, self._offsets, self._tensors)
            return
        if not self.is_current(flat):
            offsets, items = validate_unflatten(flat, self._offsets, self._tensors)
            if not self._kept(flat, offsets, items):
                if self._float64:
                    reference.unflatten(flat, offsets, self._tensors)
                else:
                    unflatten_validated(flat, offsets, items, self._tensors)
                return
        launch_unflatten(self._prepared, flat)

    def prepare(self, flat: torch.Tensor) -> bool:
        """Validate ``flat`` and the outputs as :func:`flashfsdp.kernels.unflatten` does and keep
        the segment table for them, without launching (whatever the backend); return whether
        a table is kept (not for non-contiguous or float64 outputs).

        Raises:
            TypeError, ValueError: as :func:`flashfsdp.kernels.unflatten`, with its messages.
        """
        return self._kept(flat, *validate_unflatten(flat, self._offsets, self._tensors))

    def _table_of(self, flat: torch.Tensor, offsets: list[int],
                  items: ScannedItems) -> tuple[torch.Tensor, int] | None:
        return unflatten_table(flat, offsets, items)


class FlattenPlan(_LaunchPlan):
    """:func:`flashfsdp.kernels.flatten` of fixed tensors into any flat buffer, its launch
    prepared once.

    ``plan.run(out, scale)`` does what ``flatten(tensors, offsets, out, scale=scale,
    numels=numels)`` does, with the same errors; on the Triton path, after the first run, it
    checks ``out`` and ``scale`` in O(1) and the tensors' addresses in one pass, and launches
    the kept segment table (the module docstring; the caller keeps [Note: launch plan contract]).

    Args:
        tensors: tensors of any shape, float32/bfloat16/float16/float64, or ``None`` (a range
            zeroed like a gap); the plan keeps the list (a copy of it).
        offsets: element offset of each entry's range in the flat buffer (ints; disjoint).
        numels: optional element count per entry (a ``None`` entry's length).

    Attributes:
        builds: as :class:`UnflattenPlan`'s.
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None], offsets: Sequence[int], *,
                 numels: Sequence[int] | None = None):
        super().__init__(tensors, offsets)
        self._numels = None if numels is None else (
            numels.tolist() if isinstance(numels, torch.Tensor) else list(numels))

    def run(self, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Write every tensor, cast and scaled, at its offset of ``out`` and zeros everywhere
        else; return ``out``.

        Args:
            out: 1-D contiguous float32/bfloat16/float16/float64 buffer on the tensors' device
                (any buffer each call; a new address, size or dtype is checked in full).
            scale: factor applied in fp32 before the cast (finite in fp32).

        Raises:
            TypeError, ValueError, RuntimeError: as :func:`flashfsdp.kernels.flatten`, with its
                messages.
        """
        if not isinstance(out, torch.Tensor) or op_backend(
                "flatten", out, float64=self._float64) == "reference":
            return reference.flatten(self._tensors, self._offsets, out, scale=scale, numels=self._numels)
        if self.is_current(out):
            scale = check_scale("flatten", scale)
        else:
            offsets, items, scale = validate_flatten(self._tensors, self._offsets, out, scale, self._numels)
            if not self._kept(out, offsets, items):
                if self._float64:
                    return reference.flatten(self._tensors, offsets, out, scale=scale, numels=self._numels)
                return flatten_validated(self._tensors, offsets, items, out, scale)
        launch_flatten(self._prepared, out, scale)
        return out

    def prepare(self, out: torch.Tensor) -> bool:
        """Validate ``out`` and the tensors as :func:`flashfsdp.kernels.flatten` does and keep
        the segment table for them, without launching (whatever the backend); return whether
        a table is kept (not for non-contiguous or float64 tensors).

        Raises:
            TypeError, ValueError: as :func:`flashfsdp.kernels.flatten`, with its messages.
        """
        offsets, items, _ = validate_flatten(self._tensors, self._offsets, out, 1.0, self._numels)
        return self._kept(out, offsets, items)

    def _table_of(self, flat: torch.Tensor, offsets: list[int],
                  items: ScannedItems) -> tuple[torch.Tensor, int] | None:
        return flatten_table(offsets, items, flat)
