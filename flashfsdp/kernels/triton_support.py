"""Guarded import of Triton, and the mode (compiled or interpreted) the kernels were built in.

``import flashfsdp.kernels`` must work where ``import triton`` fails (no Triton wheel, a broken
driver): then :data:`AVAILABLE` is false, :data:`triton` and :data:`tl` are stand-ins whose
``jit`` leaves functions undecorated, and :mod:`flashfsdp.kernels.dispatch` always picks the
reference path. The op modules import ``triton`` and ``tl`` from here, never directly.

[Note: interpreter mode is fixed at import]
``triton.jit`` decides when it decorates a function whether the kernel is compiled or run by the
interpreter (``TRITON_INTERPRET=1``), so the mode is fixed when this package is first imported:
set ``TRITON_INTERPRET`` before importing ``flashfsdp``. :data:`INTERPRETED` records the mode the
kernels really have, and dispatch trusts it rather than re-reading the environment.
"""

from __future__ import annotations


class _Missing:
    """Stands in for ``triton`` and ``triton.language`` when they cannot be imported.

    ``jit`` returns the function unchanged (the kernels are never launched then), ``constexpr``
    returns its value, and every other attribute is ``None``: enough to define the kernels'
    module-level names and signatures such as ``BLOCK: tl.constexpr``.
    """

    def jit(self, fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    def constexpr(self, value=None):
        return value

    def __getattr__(self, name):
        return None


try:
    import triton
    import triton.language as tl

    AVAILABLE = True
    IMPORT_ERROR: BaseException | None = None
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except Exception as error:  # noqa: BLE001 - any failure means "no Triton", whatever its kind
    triton = _Missing()
    tl = _Missing()
    AVAILABLE = False
    IMPORT_ERROR = error
    INTERPRETED = False
