"""Soak and fault benchmarks of flashfsdp training at W = 2 on CPU (gloo).

    python -m benchmarks.soak [--quick] [--steps N] [--timeout S] [--out DIR]

- ``leaks``: 1000 steps of a tiny fully_shard'ed model, resident memory, threads and open file
  descriptors per rank at steps 10 / 500 / 1000 (and right after start-up: the process overhead),
  plain, with ``flashfsdp.profile()`` and with ``profile(aggregate=True)`` open the whole run.
- ``faults``: a rank SIGKILLed in forward, in backward and in a checkpoint save, a rank
  SIGSTOPped with a collective timeout set, and a crash at each point of
  ``flashfsdp.checkpoint.save``: time to error on every other rank, whether every rank ended,
  and whether the last good checkpoint loads (``supervisor`` runs ranks that end on their own).
- ``disagreements``: the fault table's ranks that stop doing the same thing (a save against a
  forward, uneven batch counts, a skipped backward, differing gradient sync, int8 all-gathers on
  one rank): what each rank raised, how long after parting ways, and whether it names both ranks.
- ``workload``: the model, the step and the process statistics both use.

Targets: no hang, no leak, every surviving rank's error within the collective timeout + 5 s,
the last good checkpoint always loads, every disagreement named on both ranks. ``--quick`` runs 4
plain soak steps, one fault and one disagreement.
"""
