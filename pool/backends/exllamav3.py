"""The ``exllamav3`` backend: EXL3 models in-process through ExLlamaV3; CUDA only.

Written against exllamav3 1.6.5 (``exllamav3.Generator``/``Job``; read from the PyPI
wheel), and pinned to it: a load with any other installed release fails before the import
(:data:`EXLLAMAV3_VERSION`). Each replica owns one ``Generator`` (model, paged cache,
tokenizer) and one driver thread, the only thread that calls into it after the load. The
driver loops: it takes new requests and cancellations from a thread-safe inbox (``enqueue`` and
``cancel`` between two ``iterate()`` calls), calls ``iterate()``, and puts each job's
text into that request's :class:`~pool.backends._threaded.PieceStream`, then wakes
Trio once for every stream the step touched. It never waits for the event loop or
for a client, so one slow reader cannot stall the batch; it sleeps on an event while
the generator has no job. The generator batches every job it holds, so a replica
admits ``exllama_max_batch_size`` requests at once (default ``target_inflight``) and
the scheduler keeps the rest in the pool's queue, where priorities and fairness apply.

A cancelled request posts a cancel to the inbox: the driver calls
``generator.cancel(job)`` before its next step, so the job's cache pages go back
within one token. Unload stops the driver, unloads the model (its cache goes with
it), and reports what the process keeps on the GPU (the CUDA context stays).

The KV cache quantization is one setting, ``exllama_cache_quant`` (``"<bits>"`` or
``"<k_bits>,<v_bits>"``); a load may instead send ``exllama_cache_k_bits`` and
``exllama_cache_v_bits`` together, which become it. Importing this module imports
neither exllamav3 nor torch: both come in at load, after a CUDA check, because
importing exllamav3 compiles its CUDA extension (minutes the first time).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import trio
from pydantic import Field, PositiveInt

from pool.backends._placement import GpuPlacement
from pool.backends._protocol import (
    Backend,
    Capabilities,
    FinishReason,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    LoadOverrides,
    TokenSink,
    TokensUsed,
)
from pool.backends._threaded import PieceStream, wake_streams
from pool.backends.prompt_formats import (
    ModelTemplate,
    PromptFormat,
    RenderedPrompt,
    get_prompt_format,
    thinking_modes,
)
from pool.config import CommonModelFields, invalid_load_request
from pool.errors import BackendError, PoolError

log = logging.getLogger("pool.backends.exllamav3")

# The exllamav3 release the backend is written against, and the only one it loads with:
# the calls and result fields it uses are checked against this release's source by
# tests/backends/test_exllamav3.py (scripts/fetch-exllamav3-source fetches that source and
# reads the version from this line).
EXLLAMAV3_VERSION = "1.6.5"


class ExLlamaV3Model(CommonModelFields):
    """An ExLlamaV3 (EXL3) model in-process; CUDA only."""

    backend: Literal["exllamav3"] = "exllamav3"
    device: str = "cuda"
    exllama_cache_size: PositiveInt = 8192
    exllama_cache_quant: str | None = None
    exllama_gpu_split: list[float] | None = None
    exllama_tensor_parallel: bool = False
    exllama_tp_backend: str | None = None
    exllama_max_batch_size: PositiveInt | None = None
    exllama_max_chunk_size: PositiveInt | None = None
    exllama_max_q_size: PositiveInt | None = None
    exllama_max_rq_tokens: PositiveInt | None = None


class ExLlamaV3LoadOverrides(LoadOverrides):
    exllama_cache_size: PositiveInt | None = None
    exllama_cache_quant: str | None = None
    exllama_cache_k_bits: Annotated[int, Field(ge=0, le=64)] | None = None
    exllama_cache_v_bits: Annotated[int, Field(ge=0, le=64)] | None = None
    exllama_max_rq_tokens: PositiveInt | None = None


def _exllama_bits() -> dict[str, Any]:
    return {
        "kind": "integer_or_null",
        "minimum": 2,
        "maximum": 8,
        "default": None,
        "null_means": "fp16",
        "allowed_values": [2, 3, 4, 5, 6, 7, 8],
    }


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "exllama_cache_size": {"kind": "integer", "minimum": 256, "step": 256},
    "exllama_max_rq_tokens": {"kind": "integer", "minimum": 1, "step": 1},
    "exllama_cache_k_bits": _exllama_bits(),
    "exllama_cache_v_bits": _exllama_bits(),
    "exllama_cache_quant": {"kind": "string_or_null", "format": "<bits>|<k_bits>,<v_bits>"},
}

LOAD_RECOMMENDATIONS: dict[str, dict[str, Any]] = {
    "exllama_cache_bit_pairs": {
        "kind": "pair_presets",
        "fields": ["exllama_cache_k_bits", "exllama_cache_v_bits"],
        "recommended_pairs": [
            {"label": "fp16", "exllama_cache_k_bits": None, "exllama_cache_v_bits": None},
            {"label": "8/8", "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 8},
            {"label": "8/4", "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 4},
        ],
    }
}

_CACHE_QUANT = re.compile(r"^([2-8])(?:,([2-8]))?$")
_TP_BACKENDS = ("native", "nccl")
# exllamav3.constants.PAGE_SIZE: the cache is allocated in pages of this many tokens.
_PAGE_SIZE = 256
# Cleanup deadline for stopping the driver and freeing the model (one generator step
# plus the unload; the replica bounds the whole close with engine.unload_timeout_s).
_CLOSE_TIMEOUT_S = 60.0
_MIB = 1024 * 1024


def cache_bits(quant: str | None) -> tuple[int, int] | None:
    """``exllama_cache_quant`` as ``(k_bits, v_bits)``; None for the FP16 cache.

    Raises:
        BackendError: a value that is neither ``"<bits>"`` nor ``"<k_bits>,<v_bits>"`` (2-8).
    """
    if quant is None:
        return None
    match = _CACHE_QUANT.match(quant.replace(" ", ""))
    if match is None:
        raise BackendError(
            f"exllama_cache_quant must be '<bits>' or '<k_bits>,<v_bits>' with bits 2-8"
            f" (got {quant!r})"
        )
    k_bits = int(match.group(1))
    return k_bits, int(match.group(2) or k_bits)


@dataclass(frozen=True)
class LoadPlan:
    """How a definition maps onto exllamav3's calls; plain data, built before any import.

    Attributes:
        model_dir: the EXL3 model folder (``Config.from_directory``).
        cache_tokens: ``Cache(max_num_tokens=...)``.
        cache_bits: ``(k_bits, v_bits)`` for ``CacheLayer_quant``; None for ``CacheLayer_fp16``.
        batch_size: ``Generator(max_batch_size=...)``, ``Cache(max_batch_size=...)`` (its
            recurrent-state slots) and the replica's inflight target.
        load_kwargs: ``Model.load(**load_kwargs)``: one device, a ``gpu_split``
            (``use_per_device``, GB per device) or tensor parallel.
        generator_kwargs: the optional ``Generator`` sizes (chunk, q).
        max_rq_tokens: ``Job(max_rq_tokens=...)``.
    """

    model_dir: Path
    cache_tokens: int
    cache_bits: tuple[int, int] | None
    batch_size: int
    load_kwargs: dict[str, Any]
    generator_kwargs: dict[str, Any]
    max_rq_tokens: int | None


# A split gives each GPU this much over its planned share: exllamav3 fills the devices
# in order up to their limits, and an estimate that falls a little short must still fit.
_SPLIT_SLACK = 1.1


def load_plan(
    definition: ExLlamaV3Model, model_dir: Path, placement: GpuPlacement | None = None
) -> LoadPlan:
    """Map the ``exllama_*`` fields onto exllamav3's arguments.

    Where the pool placed the replica (``placement``, real GPUs) and the definition
    names no split and ``device: cuda``: that GPU, or a ``gpu_split`` of the planned
    shares (GB per CUDA device, with 10% slack) when the replica spans several.

    Raises:
        BackendError: a value exllamav3 would refuse, said in the pool's field names.
    """
    if definition.exllama_cache_size % _PAGE_SIZE:
        raise BackendError(
            f"exllama_cache_size must be a multiple of {_PAGE_SIZE} (exllamav3 pages its cache);"
            f" got {definition.exllama_cache_size}"
        )
    batch = _batch_size(definition)
    load_kwargs: dict[str, Any] = {"max_batch_size": batch}
    if definition.exllama_max_chunk_size is not None:
        load_kwargs["max_chunk_size"] = definition.exllama_max_chunk_size
    split = definition.exllama_gpu_split
    if split is not None and (not split or any(gb < 0 for gb in split)):
        raise BackendError(f"exllama_gpu_split must list GB per GPU, none negative (got {split})")
    tp_backend = definition.exllama_tp_backend
    if definition.exllama_tensor_parallel:
        tp_backend = tp_backend or "native"
        if tp_backend not in _TP_BACKENDS:
            raise BackendError(
                f"exllama_tp_backend must be one of {', '.join(_TP_BACKENDS)} (got {tp_backend!r})"
            )
        load_kwargs.update(tensor_p=True, tp_backend=tp_backend)
        if split is not None:
            load_kwargs["use_per_device"] = list(split)
    elif tp_backend is not None:
        raise BackendError("exllama_tp_backend needs exllama_tensor_parallel: true")
    elif split is not None:
        load_kwargs["use_per_device"] = list(split)
    elif definition.device == "cuda" and (placed := _placed_devices(placement)):
        if len(placed) == 1:
            load_kwargs["device"] = f"cuda:{placed[0][0]}"
        else:
            per_device = [0.0] * (max(device for device, _ in placed) + 1)
            for device, mib in placed:
                per_device[device] = round(mib * _SPLIT_SLACK / 1024, 2)
            load_kwargs["use_per_device"] = per_device
    elif definition.device != "auto":
        # exllamav3 places modules on an explicit device; "auto" splits across all GPUs.
        load_kwargs["device"] = "cuda:0" if definition.device == "cuda" else definition.device
    generator_kwargs: dict[str, Any] = {}
    if definition.exllama_max_chunk_size is not None:
        generator_kwargs["max_chunk_size"] = definition.exllama_max_chunk_size
    if definition.exllama_max_q_size is not None:
        generator_kwargs["max_q_size"] = definition.exllama_max_q_size
    return LoadPlan(
        model_dir=model_dir,
        cache_tokens=definition.exllama_cache_size,
        cache_bits=cache_bits(definition.exllama_cache_quant),
        batch_size=batch,
        load_kwargs=load_kwargs,
        generator_kwargs=generator_kwargs,
        max_rq_tokens=definition.exllama_max_rq_tokens,
    )


def _placed_devices(placement: GpuPlacement | None) -> list[tuple[int, int]]:
    """(CUDA device, MiB) of a placement on real GPUs the process sees; else empty."""
    if placement is None or placement.virtual or not placement.gpus:
        return []
    devices = placement.local_indices()
    return [] if devices is None else list(zip(devices, placement.mib, strict=True))


def _batch_size(definition: ExLlamaV3Model) -> int:
    return definition.exllama_max_batch_size or definition.target_inflight


class _Cuda:
    """What the backend asks of ``torch.cuda``: devices and this process's memory on them."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda

    def _total(self, measure: Any) -> int:
        return sum(int(measure(i)) for i in range(int(self._cuda.device_count()))) // _MIB

    def reserved_mib(self) -> int:
        """Memory torch's allocator holds on every device (the CUDA context not counted)."""
        return self._total(self._cuda.memory_reserved)

    def allocated_mib(self) -> int:
        return self._total(self._cuda.memory_allocated)

    def empty_cache(self) -> None:
        self._cuda.empty_cache()


def _open_cuda() -> _Cuda:
    """torch's CUDA, checked before exllamav3 is imported (its import compiles CUDA code).

    Raises:
        BackendError: no torch, or no CUDA device (a CPU build of torch, or no GPU).
    """
    try:
        import torch
    except ImportError as exc:
        raise BackendError(
            "exllamav3 needs PyTorch with CUDA, and torch is not installed"
            " (install the CUDA build that matches the driver, then exllamav3)"
        ) from exc
    if not torch.cuda.is_available():
        build = (
            "a CPU-only build"
            if torch.version.cuda is None
            else f"built for CUDA {torch.version.cuda}"
        )
        raise BackendError(
            f"exllamav3 needs an NVIDIA GPU with CUDA: torch {torch.__version__} ({build})"
            " sees no CUDA device"
        )
    return _Cuda(torch.cuda)


@dataclass(frozen=True)
class _Library:
    """The exllamav3 names the backend uses (every one checked by the tests' source check)."""

    Config: Any
    Model: Any
    Cache: Any
    CacheLayer_fp16: Any
    CacheLayer_quant: Any
    Tokenizer: Any
    Generator: Any
    Job: Any
    ComboSampler: Any


def _check_version() -> None:
    """The installed exllamav3 is the pinned release; read from its metadata, not imported.

    Raises:
        BackendError: not installed, or another release (both versions named).
    """
    try:
        installed = importlib.metadata.version("exllamav3")
    except importlib.metadata.PackageNotFoundError as exc:
        raise BackendError(
            f"exllamav3 is not installed (pip install exllamav3=={EXLLAMAV3_VERSION};"
            " it needs a CUDA build of torch)"
        ) from exc
    if installed != EXLLAMAV3_VERSION:
        raise BackendError(
            f"exllamav3 {installed} is installed, and this backend is written against"
            f" exllamav3 {EXLLAMAV3_VERSION} (its calls and result fields differ between"
            f" releases): install exllamav3=={EXLLAMAV3_VERSION}"
        )


def _import_library() -> _Library:
    """Import exllamav3 (on a worker thread: the first import compiles its extension).

    Raises:
        BackendError: not installed, another release than :data:`EXLLAMAV3_VERSION`, or its
            import failed (no CUDA toolkit to compile with).
    """
    _check_version()  # before the import, which may compile for minutes
    try:
        import exllamav3
    except ImportError as exc:
        raise BackendError(
            f"exllamav3 is not installed (pip install exllamav3; it needs a CUDA build of torch):"
            f" {exc}"
        ) from exc
    except Exception as exc:  # its import builds a CUDA extension, which can fail many ways
        raise BackendError(f"exllamav3 could not be imported: {type(exc).__name__}: {exc}") from exc
    return _Library(
        Config=exllamav3.Config,
        Model=exllamav3.Model,
        Cache=exllamav3.Cache,
        CacheLayer_fp16=exllamav3.CacheLayer_fp16,
        CacheLayer_quant=exllamav3.CacheLayer_quant,
        Tokenizer=exllamav3.Tokenizer,
        Generator=exllamav3.Generator,
        Job=exllamav3.Job,
        ComboSampler=exllamav3.ComboSampler,
    )


@dataclass
class _Loaded:
    """One replica's exllamav3 objects, as the load left them."""

    config: Any
    model: Any
    cache: Any
    tokenizer: Any
    generator: Any
    vram_mib: int
    allocated_before_mib: int


def _load_blocking(lib: _Library, cuda: _Cuda, plan: LoadPlan) -> _Loaded:
    """Config, model, cache, load, tokenizer, generator: the order exllamav3 requires
    (the cache must exist before ``model.load()``, which allocates it)."""
    reserved_before, allocated_before = cuda.reserved_mib(), cuda.allocated_mib()
    model: Any = None
    try:
        config = lib.Config.from_directory(str(plan.model_dir))
        model = lib.Model.from_config(config)
        if plan.cache_bits is None:
            layer: dict[str, Any] = {"layer_type": lib.CacheLayer_fp16}
        else:
            k_bits, v_bits = plan.cache_bits
            layer = {"layer_type": lib.CacheLayer_quant, "k_bits": k_bits, "v_bits": v_bits}
        cache = lib.Cache(
            model, max_num_tokens=plan.cache_tokens, max_batch_size=plan.batch_size, **layer
        )
        model.load(**plan.load_kwargs)
        tokenizer = lib.Tokenizer.from_config(config)
        generator = lib.Generator(
            model=model,
            cache=cache,
            tokenizer=tokenizer,
            max_batch_size=plan.batch_size,
            **plan.generator_kwargs,
        )
    except BackendError:
        raise
    except Exception as exc:  # the library reports bad folders and sizes with asserts
        if model is not None:
            _unload_quietly(model)
        raise BackendError(
            f"exllamav3 could not load {plan.model_dir}: {type(exc).__name__}: {exc}"
        ) from exc
    return _Loaded(
        config=config,
        model=model,
        cache=cache,
        tokenizer=tokenizer,
        generator=generator,
        vram_mib=max(0, cuda.reserved_mib() - reserved_before),
        allocated_before_mib=allocated_before,
    )


def _unload_quietly(model: Any) -> None:
    try:
        model.unload()
    except Exception:  # already failing; the first error is the one to report
        log.exception("exllamav3: unloading after a failed load failed")


@dataclass(eq=False, slots=True)
class _Request:
    """One request between the Trio side and the driver thread."""

    request: GenerationRequest
    rendered: RenderedPrompt
    stream: PieceStream = field(default_factory=PieceStream)
    job: Any = None
    prompt_tokens: int | None = None
    tokenize_ms: float | None = None
    stats: GenerationStats | None = None
    # The request's running count (the sink's): written on the driver thread.
    used: TokensUsed = field(default_factory=TokensUsed)


class _Driver:
    """The one thread that calls into a replica's generator.

    The Trio side only appends to the inbox (under a lock that the thread takes once,
    when it ends, so nothing is submitted to a driver that is gone) and sets an event.
    """

    def __init__(
        self,
        lib: _Library,
        loaded: _Loaded,
        plan: LoadPlan,
        model_name: str,
        thread_name: str,
    ) -> None:
        self._lib = lib
        self._generator = loaded.generator
        self._tokenizer = loaded.tokenizer
        self._plan = plan
        self._model_name = model_name
        self._add_bos = _adds_bos(loaded.tokenizer)
        self._eos_ids = _eos_ids(loaded.config, loaded.tokenizer)
        self._inbox: deque[tuple[str, _Request | None]] = deque()
        self._work = threading.Event()
        self._lock = threading.Lock()
        self._gone = False
        self._jobs: dict[Any, _Request] = {}
        self._touched: dict[int, PieceStream] = {}
        self._trio_token = trio.lowlevel.current_trio_token()
        self._failed = trio.Event()
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    # -- Trio side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: _Request) -> None:
        self._post("start", request)

    def cancel(self, request: _Request) -> None:
        self._post("cancel", request)

    def stop(self) -> None:
        self._post("stop", None)

    def _post(self, kind: str, request: _Request | None) -> None:
        with self._lock:
            if self._gone:
                if kind == "start":
                    raise BackendError(
                        f"the exllamav3 generator of {self._model_name!r} has stopped"
                        + (f": {self.failure}" if self.failure else "")
                    )
                return
            self._inbox.append((kind, request))
        self._work.set()

    def join(self, timeout: float) -> bool:
        """Blocking: wait for the thread to end; False if it did not within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    async def wait_failed(self) -> str:
        await self._failed.wait()
        return self.failure or "the exllamav3 generator failed"

    # -- driver thread ---------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._work.clear()
                if not self._take_inbox():
                    break
                if self._jobs and self.failure is None:
                    self._step()
                self._flush()
                if not self._jobs and not self._inbox:
                    self._work.wait()
        except BaseException as exc:  # a bug here must not leave requests waiting forever
            log.exception("exllamav3 driver of %s crashed", self._model_name)
            self._fail(f"the driver crashed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._gone = True
                left = [request for _, request in self._inbox if request is not None]
                self._inbox.clear()
            closing = BackendError(f"model {self._model_name!r} is unloading")
            for request in [*self._jobs.values(), *left]:
                if not request.stream.finished:
                    request.stream.finish(closing)
                    self._touched[id(request.stream)] = request.stream
            self._jobs.clear()
            self._flush()

    def _take_inbox(self) -> bool:
        """New jobs in, cancelled jobs out; False once asked to stop."""
        while self._inbox:
            kind, request = self._inbox.popleft()
            if kind == "stop":
                for job in list(self._jobs):
                    self._generator.cancel(job)
                return False
            assert request is not None
            if kind == "start":
                self._start(request)
            elif request.job is not None and self._jobs.pop(request.job, None) is not None:
                self._generator.cancel(request.job)
                request.stream.finish()
        return True

    def _start(self, request: _Request) -> None:
        if self.failure is not None:
            self._finish(request, BackendError(f"the exllamav3 generator failed: {self.failure}"))
            return
        try:
            job = self._job(request)
            self._generator.enqueue(job)
        except PoolError as exc:
            self._finish(request, exc)
            return
        # exllamav3 refuses jobs with asserts (e.g. too big for the cache): this request's error.
        except Exception as exc:  # noqa: BLE001 - handed to the request as a BackendError
            self._finish(
                request, BackendError(f"exllamav3 refused the request: {type(exc).__name__}: {exc}")
            )
            return
        request.job = job
        self._jobs[job] = request

    def _job(self, request: _Request) -> Any:
        """The ``Job`` of one request: its prompt ids, sampler and stop conditions."""
        started = time.perf_counter()
        ids = self._tokenizer.encode(
            request.rendered.text, add_bos=self._add_bos, encode_special_tokens=True
        )
        request.tokenize_ms = round((time.perf_counter() - started) * 1000.0, 3)
        prompt_tokens = int(ids.shape[-1])
        request.prompt_tokens = prompt_tokens
        room = self._plan.cache_tokens
        # The reply needs at least one cache position after the prompt.
        if prompt_tokens + 1 > room:
            raise PoolError(
                "invalid_request",
                f"the prompt is {prompt_tokens} tokens; model {request.request.model!r} has a"
                f" cache of {room} tokens",
                details={"prompt_tokens": prompt_tokens, "cache_tokens": room},
            )
        decoding = request.request.decoding
        return self._lib.Job(
            input_ids=ids,
            max_new_tokens=decoding.max_tokens,
            stop_conditions=self._stop_conditions(request),
            sampler=self._lib.ComboSampler(
                rep_p=decoding.repetition_penalty,
                temperature=decoding.temperature,  # 0 selects the argmax sampler
                top_k=decoding.top_k,
                top_p=decoding.top_p,
            ),
            max_rq_tokens=self._plan.max_rq_tokens,
        )

    def _stop_conditions(self, request: _Request) -> list[int | str]:
        conditions: list[int | str] = list(self._eos_ids)
        for stop in dict.fromkeys([*request.rendered.stop, *request.request.decoding.stop]):
            if not stop:
                continue
            conditions.append(stop)
            # A stop that is one special token (ChatML's <|im_end|>) decodes to no text,
            # so the string never shows up: stop on its id as well.
            token_id = self._tokenizer.single_id(stop)
            if token_id is not None:
                conditions.append(int(token_id))
        return list(dict.fromkeys(conditions))

    def _step(self) -> None:
        try:
            results = self._generator.iterate()
        except Exception as exc:
            # Not one job's failure (those come back as "error" results): the generator
            # is unusable. Every request fails, and the replica fails the model.
            log.exception("exllamav3 generator of %s failed", self._model_name)
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        for result in results:
            request = self._jobs.get(result["job"])
            if request is None:
                continue
            stage = result.get("stage")
            if stage == "error":
                del self._jobs[result["job"]]
                error = result.get("error")
                self._finish(
                    request,
                    BackendError(f"exllamav3 failed the request: {type(error).__name__}: {error}"),
                )
            elif stage == "streaming":
                # A streaming result comes after the prefill: the prompt is used.
                request.used.prompt_tokens = request.prompt_tokens
                text = result.get("text")
                if text:
                    request.stream.put(text)
                    self._touched[id(request.stream)] = request.stream
                if result.get("eos"):
                    del self._jobs[result["job"]]
                    request.stats = self._stats(request, result)
                    self._finish(request, None)

    def _stats(self, request: _Request, result: Mapping[str, Any]) -> GenerationStats:
        """Per-request numbers from the job's end-of-stream result (Job.receive_sample)."""
        enqueued, prefill = result.get("time_enqueued"), result.get("time_prefill")
        generate = result.get("time_generate")
        first_ms = None
        if enqueued is not None and prefill is not None:
            first_ms = (float(enqueued) + float(prefill)) * 1000.0 + (request.tokenize_ms or 0.0)
        total_ms = None
        if prefill is not None and generate is not None:
            total_ms = (float(prefill) + float(generate)) * 1000.0
        finish: FinishReason = "length" if result.get("eos_reason") == "max_new_tokens" else "stop"
        prompt_tokens = result.get("prompt_tokens", request.prompt_tokens)
        output_tokens = result.get("new_tokens")
        # The stop string that ended it (eos_reason "stop_string").
        stop = result.get("eos_triggering_string")
        return GenerationStats(
            prompt_tokens=None if prompt_tokens is None else int(prompt_tokens),
            output_tokens=None if output_tokens is None else int(output_tokens),
            tokenize_ms=request.tokenize_ms,
            time_to_first_token_ms=None if first_ms is None else round(first_ms, 3),
            generate_ms=None if total_ms is None else round(total_ms, 3),
            finish_reason=finish,
            stop_sequence=stop if isinstance(stop, str) else None,
        )

    def _finish(self, request: _Request, failure: BaseException | None) -> None:
        request.stream.finish(failure)
        self._touched[id(request.stream)] = request.stream

    def _fail(self, reason: str) -> None:
        self.failure = reason
        error = BackendError(f"the exllamav3 generator failed: {reason}")
        for request in self._jobs.values():
            self._finish(request, error)
        self._jobs.clear()
        with contextlib.suppress(trio.RunFinishedError):
            self._trio_token.run_sync_soon(self._failed.set)

    def _flush(self) -> None:
        """One call into Trio for every stream this step touched."""
        if self._touched:
            touched, self._touched = list(self._touched.values()), {}
            wake_streams(self._trio_token, touched)


def _adds_bos(tokenizer: Any) -> bool:
    """Whether prompts get the BOS token: the model's tokenizer_config says so.

    The pool's prompt formats leave BOS out (see prompt_formats); exllamav3's ``encode``
    adds it only when asked.
    """
    settings = getattr(tokenizer, "tokenizer_config_dict", None) or {}
    return bool(settings.get("add_bos_token", False))


def _eos_ids(config: Any, tokenizer: Any) -> list[int]:
    ids = list(getattr(config, "eos_token_id_list", None) or [])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(eos)
    return [int(i) for i in dict.fromkeys(ids) if i is not None]


def _model_template(tokenizer: Any, model_dir: Path, add_bos: bool) -> ModelTemplate | None:
    """The chat template a transformers checkout ships (tokenizer_config or chat_template.jinja)."""
    settings = getattr(tokenizer, "tokenizer_config_dict", None) or {}
    source = settings.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja = model_dir / "chat_template.jinja"
    if not source and jinja.is_file():
        source = jinja.read_text(encoding="utf-8")
    if not source and (model_dir / "chat_template.json").is_file():
        source = json.loads((model_dir / "chat_template.json").read_text("utf-8")).get(
            "chat_template"
        )
    if not isinstance(source, str) or not source:
        return None
    return ModelTemplate(
        source,
        str(getattr(tokenizer, "bos_token", "") or ""),
        str(getattr(tokenizer, "eos_token", "") or ""),
        add_bos,
    )


class ExLlamaV3Runtime:
    """One replica: a loaded generator, its driver thread and its prompt format."""

    def __init__(
        self,
        loaded: _Loaded,
        driver: _Driver,
        cuda: _Cuda,
        definition: ExLlamaV3Model,
        prompt_format: PromptFormat,
        limiter: trio.CapacityLimiter,
    ) -> None:
        self._loaded: _Loaded | None = loaded
        self._driver = driver
        self._cuda = cuda
        self._definition = definition
        self._format = prompt_format
        # Load, render and release take turns on this thread limiter; generation runs
        # on the driver thread.
        self._limiter = limiter
        self._vram_mib: int | None = loaded.vram_mib
        self._closed = False
        self.retained_mib: int | None = None

    @property
    def vram_mib(self) -> int | None:
        """torch's memory for this replica while loaded; after close, what stayed allocated."""
        return self._vram_mib

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if self._closed:
            raise BackendError("the exllamav3 runtime is closed")
        # On a worker thread: a model's own chat template can be slow.
        rendered = await trio.to_thread.run_sync(self._render, request, limiter=self._limiter)
        job = _Request(request, rendered, used=sink.used)
        self._driver.submit(job)
        try:
            await job.stream.deliver(sink)
        finally:
            if not job.stream.finished:
                # Cancelled, or the sink failed: the driver cancels the job before its
                # next step; nothing here waits for that.
                self._driver.cancel(job)
        assert job.stats is not None
        return job.stats

    def _render(self, request: GenerationRequest) -> RenderedPrompt:
        return self._format.render(request, enable_thinking=self._definition.enable_thinking)

    async def wait_failed(self) -> str:
        """Returns when the generator failed as a whole (the replica then fails the model)."""
        return await self._driver.wait_failed()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._driver.stop()
        stopped = await trio.to_thread.run_sync(
            self._driver.join, _CLOSE_TIMEOUT_S, limiter=self._limiter
        )
        if not stopped:
            # Freeing the model under a generator step would crash the process.
            log.warning("exllamav3: the driver did not stop; the model stays loaded")
            return
        await trio.to_thread.run_sync(self._release, limiter=self._limiter)

    def _release(self) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        allocated_before = loaded.allocated_before_mib
        try:
            loaded.generator.close()
        finally:
            # Unloading the model frees its weights and the cache tensors it allocated.
            loaded.model.unload()
            del loaded
            gc.collect()
            self._cuda.empty_cache()
        self.retained_mib = max(0, self._cuda.allocated_mib() - allocated_before)
        self._vram_mib = self.retained_mib
        log.info(
            "exllamav3: unloaded; %d MiB stay allocated by this replica, the process holds"
            " %d MiB reserved (the CUDA context comes on top)",
            self.retained_mib,
            self._cuda.reserved_mib(),
        )


class ExLlamaV3Backend(Backend[ExLlamaV3Model]):
    config = ExLlamaV3Model
    load_overrides = ExLlamaV3LoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    load_recommendations = LOAD_RECOMMENDATIONS
    context_field = "exllama_cache_size"

    def check_load_override(self, patch: Mapping[str, Any]) -> None:
        super().check_load_override(patch)
        quant = patch.get("exllama_cache_quant")
        if quant is not None and not _CACHE_QUANT.match(str(quant)):
            raise invalid_load_request(
                f"exllama_cache_quant must be '<bits>' or '<k_bits>,<v_bits>' with bits 2-8"
                f" (got {quant!r})",
                "exllama_cache_quant",
            )
        has_k, has_v = "exllama_cache_k_bits" in patch, "exllama_cache_v_bits" in patch
        if has_k != has_v:
            raise invalid_load_request(
                "exllama_cache_k_bits and exllama_cache_v_bits must be sent together"
            )
        if has_k and "exllama_cache_quant" in patch:
            raise invalid_load_request(
                "exllama_cache_quant cannot be combined with"
                " exllama_cache_k_bits/exllama_cache_v_bits"
            )
        if has_k and (patch["exllama_cache_k_bits"] is None) != (
            patch["exllama_cache_v_bits"] is None
        ):
            raise invalid_load_request(
                "exllama_cache_k_bits and exllama_cache_v_bits must both be null or both set"
            )

    def apply_load_override(
        self, definition: ExLlamaV3Model, patch: Mapping[str, Any]
    ) -> ExLlamaV3Model:
        update = dict(patch)
        if "exllama_cache_k_bits" in update:
            k, v = update.pop("exllama_cache_k_bits"), update.pop("exllama_cache_v_bits")
            update["exllama_cache_quant"] = None if k is None else f"{k},{v}"
        return super().apply_load_override(definition, update)

    def holds_cuda_context(self, definition: ExLlamaV3Model) -> bool:
        return definition.device != "cpu"  # torch's context and caching allocator stay

    def capabilities(self, definition: ExLlamaV3Model) -> Capabilities:
        return Capabilities(
            modalities=("text",),
            # Single-turn `input` for every prompt format: the spec puts ExLlamaV3 with
            # CT2 among the single-turn backends (docs/backends.md, "exllamav3").
            multi_turn=False,
            thinking_modes=thinking_modes(definition.prompt_format),
        )

    def effective_target_inflight(self, definition: ExLlamaV3Model) -> int:
        # One generator batches every job it holds: the batch size is what a replica
        # honestly runs at once. The rest wait in the pool's queue, not the generator's.
        return _batch_size(definition)

    async def load(self, definition: ExLlamaV3Model, context: LoadContext) -> ExLlamaV3Runtime:
        model_dir = context.model_path(definition.model_path)
        if not model_dir.is_dir():
            raise BackendError(
                f"exllamav3 loads a model folder (config.json and EXL3 safetensors);"
                f" {model_dir} is not a folder"
            )
        plan = load_plan(definition, model_dir, context.placement)
        limiter = trio.CapacityLimiter(1)
        # Both imports take seconds (minutes for exllamav3's first compile): off the loop.
        cuda = await trio.to_thread.run_sync(_open_cuda, limiter=limiter)
        lib = await trio.to_thread.run_sync(_import_library, limiter=limiter)
        loaded = await trio.to_thread.run_sync(
            partial(_load_blocking, lib, cuda, plan), limiter=limiter
        )
        try:
            prompt_format = _prompt_format(definition, loaded, model_dir)
        except (BackendError, PoolError, ValueError) as exc:
            with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
                await trio.to_thread.run_sync(_unload_quietly, loaded.model, limiter=limiter)
            raise BackendError(str(exc)) from exc
        driver = _Driver(
            lib,
            loaded,
            plan,
            context.model_name,
            f"exllamav3-{context.model_name}-{context.replica_index}",
        )
        driver.start()
        return ExLlamaV3Runtime(loaded, driver, cuda, definition, prompt_format, limiter)


def _prompt_format(definition: ExLlamaV3Model, loaded: _Loaded, model_dir: Path) -> PromptFormat:
    template = None
    if definition.prompt_format == "model_template":
        template = _model_template(loaded.tokenizer, model_dir, _adds_bos(loaded.tokenizer))
        if template is None:
            raise BackendError(
                "prompt_format model_template: the model folder has no chat template"
            )
    return get_prompt_format(definition.prompt_format, model_template=template)


BACKEND = ExLlamaV3Backend()
