"""Serving: a request's way in. Admission and intake, the waits a request sits through,
the relay to another node, the pool's health and the tracing protocol. The floor above
the residency, the accounting and the models.

Public names are exported by :mod:`pool.actors`; these modules are its private parts.
"""
