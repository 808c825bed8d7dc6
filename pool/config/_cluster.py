"""``engine.cluster``: several pools (and other GPU users) as one, through Redis.

Unset ``redis_url`` leaves the pool on its own. The timings are settings so tests can
shrink them; docs/cluster.md explains each key and script they govern.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ClusterSettings(BaseModel):
    """The ``engine.cluster`` section (docs/cluster.md)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    redis_url: str | None = Field(
        None,
        description="redis:// URL of the shared Redis (or Valkey); unset: no cluster, no"
        " shared lease ledger.",
    )
    key_prefix: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")] = Field(
        "llm-pool", description="Prefix of every key and channel, so pools can share a Redis."
    )
    node_id: str | None = Field(
        None,
        description="This pool's name in the cluster, unique among live nodes (default:"
        " service.runner_id, else the host name, and the port the pool listens on).",
    )
    gpu_host: str | None = Field(
        None,
        description="The machine whose GPUs leases name (default: the host name). Pools and"
        " jobs that give the same value share the same GPUs' budgets.",
    )
    advertise_url: str | None = Field(
        None,
        description="The URL peers relay requests to (default: the bound address).",
    )
    lease_ttl_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        15.0, description="A lease not renewed for this long expires."
    )
    lease_renew_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        5.0, description="How often held leases are renewed."
    )
    node_ttl_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        15.0, description="A node that has not renewed its registration for this long is gone."
    )
    heartbeat_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        5.0, description="How often the node renews its registration."
    )
    redis_timeout_s: Annotated[float, Field(gt=0.0, le=60.0)] = Field(
        2.0, description="Connect and reply timeout of each Redis call."
    )
    load_lock_ttl_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        120.0,
        description="Expiry of the cluster-wide lock that lets one node load a model for"
        " a peer's request (renewed while the load runs).",
    )
    budget_refresh_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        1.0,
        description="How often a pool reads the cluster's shared budget counters (what the"
        " other pools spent); its own spending is added at once.",
    )
    affinity_keys: Annotated[int, Field(ge=0, le=1024)] = Field(
        64,
        description="Recent prompts per loaded model a node names in its registry record"
        " (one 16-character hex key each, about 19 bytes of the record), so that a peer"
        " sends a conversation's next turn where its prefix is cached; 0: none (routing"
        " by load alone). Needs engine.prefix_affinity.",
    )
    affinity_max_queue: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        0,
        description="A node is preferred for the prompt prefix it holds only while a"
        " request would take at most this place in its queue for the model; 0: only while"
        " it has a free slot, so affinity makes no request wait.",
    )

    @model_validator(mode="after")
    def _renew_before_expiry(self) -> ClusterSettings:
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError("lease_renew_s must be shorter than lease_ttl_s")
        if self.heartbeat_s >= self.node_ttl_s:
            raise ValueError("heartbeat_s must be shorter than node_ttl_s")
        return self
