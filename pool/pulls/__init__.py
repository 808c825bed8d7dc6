"""Pulls: background downloads of models into the model store.

One concern per module: ``_sources`` turns a source (local path, URL, Hugging Face
repo id) into files; ``_download`` fetches and verifies them, resumably;
``_install`` places them in the store and writes the manifest; ``_store`` keeps every
path inside the store; ``_handle`` is one pull's state and its watchers; ``_manager``
is the actor that runs pulls and points models at what they pulled.
"""

from pool.pulls._digests import FileDigests, FileFacts
from pool.pulls._handle import FINAL_STATUSES, PullEvents, PullHandle, PullStatus
from pool.pulls._manager import PulledModel, PullManager
from pool.pulls._sources import SourceKind, classify_source, url_file_name
from pool.pulls._store import ModelStore, default_store

__all__ = [
    "FINAL_STATUSES",
    "FileDigests",
    "FileFacts",
    "ModelStore",
    "PullEvents",
    "PullHandle",
    "PullManager",
    "PullStatus",
    "PulledModel",
    "SourceKind",
    "classify_source",
    "default_store",
    "url_file_name",
]
