"""Models: one actor per configured model, its replicas, its scheduler and the tickets
that queue on it, and the Prometheus metrics the actors feed and are read by. It reports
facts and carries out commands; it knows no residency.

Public names are exported by :mod:`pool.actors`; these modules are its private parts.
"""
