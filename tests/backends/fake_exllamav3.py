"""A stand-in for the ``exllamav3`` package at the names the backend imports (tests only).

The machines that run the suite have no GPU, and importing the real package compiles
its CUDA extension, so the unit tests put this module in ``sys.modules["exllamav3"]``
and a :class:`FakeCuda` in place of ``torch.cuda``. Everything above that boundary (the
driver thread, the pool, the replica) is the real code.

The shapes follow exllamav3 1.6.5, read from the PyPI wheel
``exllamav3-1.6.5-py3-none-any.whl`` (line numbers of that version):

- ``Generator.iterate()`` returns a list of dicts (``generator/generator.py`` 674-735,
  its docstring). ``"started"`` results (``job``, ``stage``, ``eos: False``, ``serial``)
  come from ``Generator.iterate_start_jobs`` (2165-2222), which moves pending jobs into
  the batch while it holds fewer than ``max_batch_size`` sequences.
- ``"streaming"`` results come from ``Job.receive_sample``'s ``emit()``
  (``generator/job.py`` 841-960): ``job``, ``stage``, ``eos``, ``serial``, and ``text``
  only when there is text to release. At the end also ``eos_reason`` (``"stop_token"``
  993, ``"max_new_tokens"`` 998, ``"stop_string"`` 1177), ``full_completion``,
  ``new_tokens`` (the stop token counts: it is accepted before the check, 812),
  ``prompt_tokens`` (935), ``time_enqueued``, ``time_prefill`` (time to first token)
  and ``time_generate`` in seconds, ``cached_pages``, ``cached_tokens``.
- Text that may begin a stop string is held back (1160-1183); the stop string and what
  follows it are never emitted, nor is a stop token's text (993).
- ``"error"`` results (``job``, ``serial``, ``stage``, ``eos: True``, ``error``) come
  from ``Generator.reap_failed_job`` (2135-2163).
- ``Generator(model, cache, tokenizer, max_batch_size=256, max_chunk_size=2048,
  max_q_size=8, ...)`` (41-60); ``enqueue(job)`` returns the serial (613-646) after
  ``Job.prepare_for_queue`` asserts that the job fits the cache (job.py 1353-1359);
  ``cancel(job)`` drops a pending or active job (649-671); ``close()`` (839);
  ``num_remaining_jobs()`` (456).
- ``Job(input_ids, max_new_tokens, min_new_tokens, max_skips, sampler, seed,
  stop_conditions, ..., max_rq_tokens, ...)`` (job.py 54-76); ``stop_conditions`` mixes
  token ids and strings (252-264).
- ``Cache(model, max_num_tokens, layer_type, max_batch_size, ..., k_bits, v_bits)``
  (``cache/cache.py`` 95-104 and 137-141; ``cache/quant.py`` 15-24 asserts 2-8 bits).
- ``Config.from_directory(directory)`` (``model/config.py`` 259) with
  ``eos_token_id_list`` (168-175); ``Model.from_config(config)`` (``model/model.py``
  171), ``Model.load(**kwargs)`` with ``load_gen``'s keywords (475-494: ``device``,
  ``use_per_device``, ``tensor_p``, ``tp_backend``, ``max_chunk_size``,
  ``max_batch_size``), ``Model.unload()`` (460).
- ``Tokenizer.from_config(config)`` (``tokenizer/tokenizer.py`` 773);
  ``encode(text, add_bos, add_eos, encode_special_tokens)`` returns a ``(1, n)`` tensor
  (445-528); ``single_id(piece)`` returns the id or None (297-309); ``eos_token_id``,
  ``tokenizer_config_dict``.
- ``ComboSampler(rep_p, ..., temperature, min_p, top_k, top_p, ...)``
  (``generator/sampler/presets.py``).

``tests/backends/test_exllamav3.py::test_the_backends_uses_of_exllamav3_are_in_its_source``
checks the backend's names, keywords and result fields against the real 1.6.5 source
(fetched by ``scripts/fetch-exllamav3-source``). The fake reports :data:`VERSION` through
package metadata (:func:`install_metadata`), which the backend's version check reads.
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The release the fake follows; the backend's pin (EXLLAMAV3_VERSION) must be the same.
VERSION = "1.6.5"
PAGE_SIZE = 256
EOS_ID = 2
SPECIAL = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": EOS_ID}
MIB = 1024 * 1024


@dataclass
class Script:
    """What the fake model generates, set by each test."""

    reply: list[str] = field(
        default_factory=lambda: ["The", "capital", "of", "France", "is", "Paris."]
    )
    # After the reply: "eos" samples the EOS token; "repeat" starts the reply again.
    then: str = "eos"
    step_s: float = 0.0
    fail_at_step: int | None = None
    model_mib: int = 512


class World:
    """Everything the fake saw, for the tests to assert on."""

    def __init__(self) -> None:
        self.script = Script()
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []
        self.models: list[Model] = []
        self.caches: list[Cache] = []
        self.generators: list[Generator] = []
        self.jobs: list[Job] = []
        self.samplers: list[ComboSampler] = []
        self.encoded: list[dict[str, Any]] = []
        self.allocated = 0

    def record(self, name: str) -> None:
        with self.lock:
            self.calls.append((name, threading.current_thread().name))


WORLD = World()


class Ids:
    """A ``(1, n)`` token id tensor, as far as the backend looks at it."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.shape = (1, len(ids))


class Config:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.eos_token_id = EOS_ID
        self.eos_token_id_list = [EOS_ID]

    @staticmethod
    def from_directory(directory: str, **kwargs: Any) -> Config:
        WORLD.record("Config.from_directory")
        return Config(directory)


class Model:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.load_kwargs: dict[str, Any] | None = None
        self.unloaded = False

    @staticmethod
    def from_config(config: Config, component: str = "text", **kwargs: Any) -> Model:
        WORLD.record("Model.from_config")
        model = Model(config)
        WORLD.models.append(model)
        return model

    def load(self, **kwargs: Any) -> None:
        WORLD.record("Model.load")
        self.load_kwargs = kwargs
        WORLD.allocated += WORLD.script.model_mib * MIB

    def unload(self) -> None:
        WORLD.record("Model.unload")
        self.unloaded = True
        WORLD.allocated -= WORLD.script.model_mib * MIB


class CacheLayer_fp16:
    pass


class CacheLayer_quant:
    pass


class Cache:
    def __init__(
        self,
        model: Model,
        max_num_tokens: int,
        layer_type: type | None = None,
        max_batch_size: int = 16,
        **kwargs: Any,
    ) -> None:
        WORLD.record("Cache")
        assert max_num_tokens % PAGE_SIZE == 0
        if layer_type is CacheLayer_quant:
            assert 2 <= kwargs["k_bits"] <= 8 and 2 <= kwargs["v_bits"] <= 8
        self.model = model
        self.max_num_tokens = max_num_tokens
        self.layer_type = layer_type or CacheLayer_fp16
        self.max_batch_size = max_batch_size
        self.kwargs = kwargs
        WORLD.caches.append(self)


class Tokenizer:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.eos_token_id = EOS_ID
        self.bos_token_id = 1
        self.tokenizer_config_dict: dict[str, Any] = {}

    @staticmethod
    def from_config(config: Config) -> Tokenizer:
        return Tokenizer(config)

    def encode(
        self,
        text: str,
        add_bos: bool = False,
        add_eos: bool = False,
        encode_special_tokens: bool = False,
        **kwargs: Any,
    ) -> Ids:
        WORLD.record("Tokenizer.encode")
        WORLD.encoded.append(
            {"text": text, "add_bos": add_bos, "encode_special_tokens": encode_special_tokens}
        )
        ids = [10 + i for i, _ in enumerate(text.split())]
        return Ids(([self.bos_token_id] if add_bos else []) + ids)

    def single_id(self, token: str) -> int | None:
        return SPECIAL.get(token)


class ComboSampler:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        WORLD.samplers.append(self)


class Job:
    def __init__(
        self,
        input_ids: Ids,
        max_new_tokens: int | None = None,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        sampler: ComboSampler | None = None,
        seed: int | None = None,
        stop_conditions: list[int | str] | None = None,
        max_rq_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        assert max_new_tokens is None or max_new_tokens >= 1
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.sampler = sampler
        self.stop_conditions = list(stop_conditions or [])
        self.stop_tokens = {c for c in self.stop_conditions if isinstance(c, int)}
        self.stop_strings = {c for c in self.stop_conditions if isinstance(c, str)}
        self.max_rq_tokens = max_rq_tokens
        self.serial_number: int | None = None
        self.new_tokens = 0
        self.held_text = ""
        self.full_completion = ""
        self.time_enqueue = 0.0
        self.time_first_token: float | None = None
        WORLD.jobs.append(self)

    def next_token(self) -> tuple[int, str]:
        reply = WORLD.script.reply
        index = self.new_tokens
        if index >= len(reply):
            if WORLD.script.then == "eos":
                return EOS_ID, ""
            index %= len(reply)
        # Word pieces with their leading space, as a BPE vocabulary has them.
        return 100 + index, reply[index] if index == 0 else " " + reply[index]


class Generator:
    def __init__(
        self,
        model: Model,
        cache: Cache,
        tokenizer: Tokenizer,
        max_batch_size: int = 256,
        max_chunk_size: int = 2048,
        max_q_size: int = 8,
        **kwargs: Any,
    ) -> None:
        WORLD.record("Generator")
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        self.max_q_size = max_q_size
        self.kwargs = kwargs
        self.pending_jobs: list[Job] = []
        self.active_jobs: list[Job] = []
        self.enqueued: list[Job] = []
        self.cancelled: list[Job] = []
        self.peak_batch = 0
        self.steps = 0
        self.closed = False
        self.job_serial = 0
        WORLD.generators.append(self)

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def enqueue(self, job: Job) -> int:
        WORLD.record("Generator.enqueue")
        assert job.input_ids.shape[-1] + 1 <= self.cache.max_num_tokens, "Job requires more pages"
        job.serial_number = self.job_serial
        self.job_serial += 1
        job.time_enqueue = time.time()
        self.pending_jobs.append(job)
        self.enqueued.append(job)
        return job.serial_number

    def cancel(self, job: Job) -> None:
        WORLD.record("Generator.cancel")
        self.cancelled.append(job)
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            self.active_jobs.remove(job)

    def clear_queue(self) -> None:
        self.pending_jobs.clear()
        self.active_jobs.clear()

    def close(self) -> None:
        WORLD.record("Generator.close")
        self.closed = True

    def iterate(self) -> list[dict[str, Any]]:
        WORLD.record("Generator.iterate")
        self.steps += 1
        script = WORLD.script
        if script.fail_at_step is not None and self.steps >= script.fail_at_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if script.step_s:
            time.sleep(script.step_s)
        results: list[dict[str, Any]] = []
        while self.pending_jobs and len(self.active_jobs) < self.max_batch_size:
            job = self.pending_jobs.pop(0)
            self.active_jobs.append(job)
            results.append(
                {"job": job, "stage": "started", "eos": False, "serial": job.serial_number}
            )
        self.peak_batch = max(self.peak_batch, len(self.active_jobs))
        for job in list(self.active_jobs):
            result = self._sample(job)
            results.append(result)
            if result["eos"]:
                self.active_jobs.remove(job)
        return results

    def _sample(self, job: Job) -> dict[str, Any]:
        token, text = job.next_token()
        job.new_tokens += 1
        if job.time_first_token is None:
            job.time_first_token = time.time()
        result: dict[str, Any] = {
            "job": job,
            "stage": "streaming",
            "eos": False,
            "serial": job.serial_number,
        }
        if token in job.stop_tokens:
            return self._end(job, result, "stop_token", emit="")
        job.held_text += text
        # The real order (job.py 992-1183): stop token, max_new_tokens, then stop strings.
        assert job.max_new_tokens is not None
        if job.new_tokens >= job.max_new_tokens:
            return self._end(job, result, "max_new_tokens", emit=job.held_text)
        for stop in job.stop_strings:
            at = job.held_text.find(stop)
            if at >= 0:
                result["eos_triggering_string"] = stop
                return self._end(job, result, "stop_string", emit=job.held_text[:at])
        if any(
            job.held_text.endswith(stop[:size])
            for stop in job.stop_strings
            for size in range(1, len(stop))
        ):
            return result  # held: it may be the start of a stop string
        if job.held_text:
            result["text"], job.held_text = job.held_text, ""
            job.full_completion += result["text"]
        return result

    def _end(self, job: Job, result: dict[str, Any], reason: str, emit: str) -> dict[str, Any]:
        if emit:
            result["text"] = emit
            job.full_completion += emit
        now = time.time()
        first = job.time_first_token or now
        result.update(
            eos=True,
            eos_reason=reason,
            full_completion=job.full_completion,
            new_tokens=job.new_tokens,
            prompt_tokens=job.input_ids.shape[-1],
            time_enqueued=0.0,
            time_prefill=first - job.time_enqueue,
            time_generate=now - first,
            cached_pages=0,
            cached_tokens=0,
        )
        return result


class FakeCuda:
    """Stands in for the backend's view of ``torch.cuda``: one device, the fake's memory."""

    def reserved_mib(self) -> int:
        return WORLD.allocated // MIB

    def allocated_mib(self) -> int:
        return WORLD.allocated // MIB

    def empty_cache(self) -> None:
        WORLD.record("cuda.empty_cache")


def module() -> types.ModuleType:
    """A module object with the real package's top-level names."""
    fake = types.ModuleType("exllamav3")
    for name, value in {
        "Config": Config,
        "Model": Model,
        "Cache": Cache,
        "CacheLayer_fp16": CacheLayer_fp16,
        "CacheLayer_quant": CacheLayer_quant,
        "Tokenizer": Tokenizer,
        "Generator": Generator,
        "Job": Job,
        "ComboSampler": ComboSampler,
    }.items():
        setattr(fake, name, value)
    return fake


def install_metadata(folder: Path, version: str) -> Path:
    """An ``exllamav3`` distribution's metadata in ``folder``, as pip leaves it: with
    ``folder`` on ``sys.path``, ``importlib.metadata.version("exllamav3")`` is ``version``."""
    dist = folder / f"exllamav3-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: exllamav3\nVersion: {version}\n", encoding="utf-8"
    )
    return folder


def reset() -> World:
    global WORLD
    WORLD = World()
    return WORLD
