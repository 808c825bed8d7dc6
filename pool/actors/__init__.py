"""The actor tree: supervisor, model actors, schedulers and replicas."""

from pool.actors._model import STATE_DESCRIPTIONS, ModelActor
from pool.actors._supervisor import Admission, Pool, new_request_id, open_pool

__all__ = [
    "STATE_DESCRIPTIONS",
    "Admission",
    "ModelActor",
    "Pool",
    "new_request_id",
    "open_pool",
]
