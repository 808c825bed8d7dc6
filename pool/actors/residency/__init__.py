"""Residency: which model is resident where. The residency owner and its records
(estimates, footprints, keep-alive, sleep), the pure planner and its gate, the GPUs,
the VRAM arithmetic, eviction, shared leases, load tasks and the decisions log. It
commands the model actors; they never import it.

Public names are exported by :mod:`pool.actors`; these modules are its private parts.
"""
