"""Checkpoints of a fully_shard'ed model (and optimizer) with torch.distributed.checkpoint (DCP).

``save(path, model, optimizer, step=N, extra={...})`` writes a DCP checkpoint of the sharded model
state dict and optimizer state (each rank writes only its pieces), ``load(path, model, optimizer)``
reads it back at any world size, ``latest(out_dir)`` finds the newest complete one. Layout of a
checkpoint directory::

    path/
      .metadata, __<rank>_0.distcp   DCP: keys "model.<name>", "optim.state.<name>.<key>", ...
      extra.pt                       torch.save({"extra": extra}) by rank 0
      flashfsdp.json                 the completion marker, written last: step, world size, time,
                                     and the CRC-32 of every other file

Reliability, module by module:

- ``atomic.py``: the directory is swapped into place by renames ([Note: atomic save]); a crash at
  any point leaves the newest complete checkpoint where ``load`` and ``latest`` find it, and the
  next save never deletes the only complete copy ([Note: recovery]).
- ``checksums.py``: CRC-32 of every file, computed as DCP writes it, verified by ``load`` before
  anything is loaded (``verify=False`` skips it).
- ``loading.py``: everything is checked before the model is touched ([Note: load is
  all-or-nothing up to the shard files]), the model's sharding included (``matching.py``: a
  DTensor whose local chunk is not the one its placements describe cannot be filled by DCP);
  ``saving.py`` / ``loading.py``: an error on one rank is raised on every rank
  (``flashfsdp.runtime.agreement``), so no rank waits in a collective.
- ``arguments.py``: the ranks compare their arguments (the path above all) before anything is
  written or read; a difference is an error on every rank naming each rank's value.
- ``space.py``: a write that finds no room (a full disk or quota, a file size limit) is raised as
  the ``OSError`` it was, naming the file and the bytes needed, not as torch's zip-writer error.

[Note: trust model]
A checkpoint directory is data: ``load`` runs no code from it. DCP's ``.metadata`` is unpickled
with an unpickler that resolves only DCP's metadata classes, torch dtypes and sizes and plain
containers (``safe_metadata.py``), non-tensor entries and ``extra.pt`` with
``torch.load(weights_only=True)``, tensors as DCP does (``weights_only=True``); anything else
named in them is refused with an error, before it is called. What a crafted checkpoint can still
do is what any data can: hold wrong values, or be made large to exhaust memory or disk; the
checksums detect accidental damage, not forgery (whoever can write the files can write the marker).
So load checkpoints from sources you would take data from; saving trusts its own process.
"""

from .discovery import latest
from .loading import load
from .marker import EXTRA, FORMAT, MARKER, VERSION  # noqa: F401 - the names flashfsdp.checkpoint had
from .saving import save

__all__ = ["save", "load", "latest", "MARKER"]
