"""The values the actors speak, the lowest floor: events, snapshots, model details.
They import no other part of :mod:`pool.actors`.

Public names are exported by :mod:`pool.actors`; these modules are its private parts.
"""
