"""``serve``: the pool, the GPU monitor and Hypercorn in one nursery, with graceful stop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from pool.actors import GpuMonitor, GpuSource, Pool, open_pool
from pool.cluster import ClusterNode, open_cluster
from pool.config import Settings
from pool.errors import ListenError, PoolError
from pool.http._access_log import AccessLog
from pool.http._app import create_app, pipeline_of
from pool.http._auth import Authenticator
from pool.http._h11_protocol import install as install_h11_protocol
from pool.http._hosts import HostAllowList
from pool.http._keep_alive import install as install_keep_alive_timer
from pool.http._metrics_port import serve_metrics
from pool.http._starting import StartingResponder
from pool.tracing import open_tracing

log = logging.getLogger("pool.server")

# How long before the shutdown grace ends the open requests are ended (at most a
# quarter of the grace): time for each stream to send its error event and close.
_LAST_WORD_S = 0.5


@dataclass
class ServerInfo:
    """Where a running server listens, and how to stop it gracefully."""

    url: str
    host: str
    port: int
    pool: Pool
    stopping: trio.Event = field(default_factory=trio.Event)

    def shutdown(self) -> None:
        """Stop accepting; open streams get ``service.shutdown_grace_s`` to finish."""
        if not self.stopping.is_set():
            log.info("shutting down: no new connections, open streams may finish")
            self.pool.begin_shutdown()
            self.stopping.set()


async def serve(
    settings: Settings,
    *,
    host: str | None = None,
    port: int | None = None,
    gpus: GpuSource | None = None,
    task_status: trio.TaskStatus[ServerInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the service until :meth:`ServerInfo.shutdown` (or cancellation).

    Reports a :class:`ServerInfo` once it listens (``port=0`` picks a free port). The
    port is bound before the pool opens, so the cluster names the node after the port
    served. After a shutdown, Hypercorn stops accepting and lets open responses run for
    up to ``service.shutdown_grace_s``; then every model is unloaded.

    Args:
        host, port: where to listen (default: ``service.host``, ``service.port``).
        gpus: where GPU memory readings come from; by default a :class:`GpuMonitor`
            polling NVML, started here (a test passes a fixed view instead), or the
            virtual GPUs of ``engine.gpu_budget_mib`` where NVML finds no GPU or
            ``engine.virtual_gpus`` asks for them.

    Raises:
        ListenError: the address cannot be bound (a port in use or out of range, a host
            that is no address here), before anything starts.
        NodeIdInUse: another live node of the cluster has this pool's node id.
    """
    host = host or settings.service.host
    port = settings.service.port if port is None else port
    # A JSON answer in one socket write; a closed idle connection closed at once; a
    # request's end told without a task; one keep-alive timer task per connection.
    install_h11_protocol()  # pool/http/_h11_protocol.py
    install_keep_alive_timer()  # pool/http/_keep_alive.py
    auth = Authenticator(settings.service.auth)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = settings.service.shutdown_grace_s
    config.logger_class = AccessLog
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = settings.service.keep_alive_s
    # Hypercorn's own default (100) can overflow in a burst while the loop is busy: the
    # kernel then drops handshakes, which clients retry a second later or see reset.
    config.backlog = settings.service.listen_backlog
    # Protocol pings (the ASGI app cannot send any): a paused stream's socket stays open.
    config.websocket_ping_interval = settings.service.websocket_ping_s
    config.websocket_max_message_size = settings.service.max_body_bytes
    # Bound before anything else: a port in use fails at once, and the port served
    # (port 0: the one picked here) is known to what is named after it, the pool's node
    # id in the cluster first. Until Hypercorn, handed it by its file descriptor, serves,
    # the socket answers 503 `starting` (pool/http/_starting.py).
    try:
        listening = config.create_sockets().insecure_sockets
    except (OSError, OverflowError) as exc:  # OverflowError: a port past 65535
        said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ListenError(
            f"cannot listen on {config.bind[0]}: {said.removeprefix('bind(): ').rstrip('.')}"
        ) from exc
    try:
        if host not in ("127.0.0.1", "localhost", "::1") and not auth.enabled:
            log.warning(
                "!!! listening on %s with no tokens configured: anyone who can reach this"
                " address can run and unload models. Set service.auth or LLM_POOL_API_TOKENS."
                " !!!",
                host,
            )
        for sock in listening:
            sock.set_inheritable(False)  # no backend started meanwhile holds the port
        port = int(listening[0].getsockname()[1])
        async with trio.open_nursery() as monitors:
            # Until the pool is open (the enabled models loaded), a request is answered
            # 503 `starting` instead of its connection being refused.
            starting = StartingResponder()
            for sock in listening:
                sock.listen(config.backlog)
            monitors.start_soon(starting.run, listening)
            if gpus is None and not settings.engine.virtual_gpus:
                monitor = await monitors.start(GpuMonitor().run)
                # No NVIDIA GPU but budgets declared: the pool runs on virtual GPUs instead.
                gpus = monitor if monitor.gpus or not settings.engine.gpu_budget_mib else None
            async with (
                open_cluster(settings, port=port) as cluster,
                open_pool(
                    settings,
                    gpus=gpus,
                    ledger=cluster,
                    router=cluster.router if cluster is not None else None,
                    budget_counters=cluster.budget_counters if cluster is not None else None,
                    tracing=open_tracing(settings.service.tracing),
                ) as pool,
            ):
                await starting.stop()
                config.bind = [f"fd://{sock.detach()}" for sock in listening]
                await _serve_pool(pool, settings, config, host, port, auth, task_status, cluster)
            monitors.cancel_scope.cancel()
    finally:
        for sock in listening:
            sock.close()  # a no-op for those handed to Hypercorn


async def _serve_pool(
    pool: Pool,
    settings: Settings,
    config: Config,
    host: str,
    port: int,
    auth: Authenticator,
    task_status: trio.TaskStatus[ServerInfo],
    cluster: ClusterNode | None = None,
) -> None:
    async with trio.open_nursery() as nursery:
        info_box: list[ServerInfo] = []
        hosts = HostAllowList(settings.service.allowed_hosts, bound_host=host, port=port)

        app = create_app(pool, settings, auth, hosts)
        pipeline = pipeline_of(app)

        async def shutdown_trigger() -> None:
            await info_box[0].stopping.wait()
            nursery.start_soon(stop_when_drained)
            nursery.start_soon(end_streams_before_the_grace_ends)

        async def end_streams_before_the_grace_ends() -> None:
            # Past the grace Hypercorn cancels what is still open, and a stream cut
            # there ends mid-chunk (the client reads a broken chunked body). Ending the
            # requests a little before lets each stream send its error event and close.
            grace = settings.service.shutdown_grace_s
            await trio.sleep(grace - min(_LAST_WORD_S, grace / 4))
            error = PoolError(
                "shutting_down",
                "the server shut down before the response completed"
                f" (service.shutdown_grace_s: {grace:g}s)",
                retry_after_s=5.0,
            )
            ended = pool.end_running(error)
            if ended:
                log.warning("shutdown grace ending: %d open request(s) ended", ended)

        async def stop_when_drained() -> None:
            # Hypercorn waits for every connection's task, and a kept-alive one can
            # outlive its last response (a request sent on it as it closes leaves the
            # task waiting for the grace). Once no response is open, nothing is owed:
            # stop at once rather than at the end of the grace.
            await trio.lowlevel.checkpoint()  # requests just read start first
            await pipeline.drained()
            http_scope.cancel()

        http_scope = trio.CancelScope()

        async def run_http(
            *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
        ) -> None:
            with http_scope:
                await hypercorn_serve(
                    app, config, shutdown_trigger=shutdown_trigger, task_status=task_status
                )
            # Hypercorn returns once open connections finished (or the grace ran out),
            # or the drain stopped it.
            nursery.cancel_scope.cancel()

        stopping = trio.Event()
        info_box.append(ServerInfo("", host, 0, pool, stopping))
        binds = await nursery.start(run_http)
        service = settings.service
        if service.metrics and service.metrics_port is not None:
            await nursery.start(serve_metrics, pool, auth, host, service.metrics_port)
        url = binds[0]
        bound_port = int(url.rsplit(":", 1)[1])
        hosts.listening_on(bound_port)
        info = info_box[0]
        info.url, info.port = url, bound_port
        if cluster is not None:
            await cluster.join(pool, url)
        task_status.started(info)
