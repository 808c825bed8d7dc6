"""Accounting: what was used and what may still be. Usage records and their store,
budgets and rate limits. It reads the metrics (pool/actors/models/_metrics.py) and
knows nothing else of the actors.

Public names are exported by :mod:`pool.actors`; these modules are its private parts.
"""
