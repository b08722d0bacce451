"""Dynamic Context Parallelism, in three rooms with one-way doors.

- ``planning/``: pure Python (no torch): cost model, planner, simulator, baselines, group layouts.
  Deterministic; every rank computes the same plan from the same lengths.
- ``attention/``: exact attention over one CP group (Ulysses, ring, 2-D) and its kernels. It knows
  nothing of plans; it imports only the pure rank layout (``planning.groups_layout``).
- ``runtime/``: the multi-process trainer: process groups, routing, the step. It uses both.

``python -m dynamic_cp.simulate`` and ``python -m dynamic_cp.calibrate`` are the user commands.
``tests/test_layout.py`` enforces the rules.
"""
