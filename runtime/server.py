"""kiln serve: an artifact behind the OpenAI API, concurrent requests sharing the model through the
continuous-batching Engine.

    HTTP (uvicorn, asyncio) ── /v1/completions, /v1/chat/completions ──> EngineLoop.submit ──┐
          ^ one asyncio queue per HTTP request                                              │
          └── events, via call_soon_threadsafe <── engine thread: engine.step(), again <───┘
    GET /v1/models, /health (503 until loaded and warmed up), /metrics (Prometheus text)

The engine steps on a thread of its own, so the event loop only parses, queues and writes: a step
never blocks a client's connection. A client that goes away (mid-stream or while waiting) aborts
its request, which frees its rows at the next step. A client that reads a stream slower than it is
written costs only itself: past --stream-buffer tokens waiting behind a write stuck on it, its
request is aborted, and a write that waits --write-timeout seconds for it aborts its connection.
SIGTERM or Ctrl-C drains: the port closes, running requests finish (up to --drain-timeout seconds,
then they are aborted), exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .device import providers_for
from .engine import Engine, Event, RequestError, Result
from .manifest import Manifest, Variant
from .openai_api import (
    FINISH_REASONS,
    GENERATION_DEFAULTS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    envelope,
    fingerprint,
    new_id,
    request_prompts,
    response_body,
    usage,
    validation_error,
)
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .model import Selection

# Bucket bounds in seconds, as vLLM's for the same histograms (dashboards built for it read these).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass
class ServeConfig:
    artifact: Path
    variant: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 32
    max_queue: int = 256
    max_prefill_tokens: int = 512
    threads: int | None = None
    api_key: str | None = None
    model_name: str | None = None  # default: the artifact's name
    drain_timeout: float = 30.0
    verify: bool = True
    max_tokens_in_flight: int | None = None  # default: what the memory plan says this host holds
    device: str | None = None  # cpu, cuda, cuda:N or auto (runtime/device.py)
    # A slow or silent client's bounds: tokens per sequence its stream may have waiting behind a stuck
    # write (then it is aborted), seconds a write may wait for it (then its connection is aborted), and
    # the kernel's send buffer per connection (without a bound Linux grows it to megabytes, which the
    # client could leave unread long before the stream buffer ever fills).
    stream_buffer: int = 256
    write_timeout: float = 30.0
    send_buffer_bytes: int | None = 256 * 1024
    prefix_cache_mib: float | None = None  # the prefix cache's budget; default: memory.prefix_cache_default, 0: off


class Metrics:
    """Prometheus metrics named after vLLM's (vllm:x -> kiln:x), so dashboards built for it port."""

    def __init__(self, model: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"kiln:{name}", doc, labels, registry=self.registry).labels(model)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"kiln:{name}", doc, labels, registry=self.registry).labels(model)

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(f"kiln:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model)

        self.running = gauge("num_requests_running", "Sequences in the running batch or its prefill.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a row.")
        self.batch_size = gauge("batch_size", "Rows in the running batch, free rows included.")
        self.kv_used = gauge("kv_cache_slots_used", "KV cache slots holding a running sequence's tokens.")
        self.kv_allocated = gauge("kv_cache_slots_allocated", "KV cache slots allocated (rows x slots per row).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).")
        self.prefix_bytes = gauge("prefix_cache_bytes", "Bytes of KV the prefix cache holds.")
        self.prefix_counted = {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = Counter("kiln:request_success", "Sequences finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.rejected = Counter("kiln:request_rejected", "Requests refused before they ran, by HTTP status.",
                                ["model_name", "status"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "From arrival to the first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive tokens of a sequence.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "From arrival until its prefill started.",
                               LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to the last token.", LATENCY_BUCKETS)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation = histogram("request_generation_tokens", "Tokens generated per sequence.",
                                            TOKEN_BUCKETS)
        self.model = model

    def gauges(self, stats: dict[str, int]) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.batch_size.set(stats["batch_rows"])
        self.kv_used.set(stats["kv_slots_used"])
        self.kv_allocated.set(stats["kv_slots_allocated"])
        self.prefix_bytes.set(stats.get("prefix_cache_bytes", 0))
        for counter, key in ((self.prefix_queries, "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits")):
            total = stats.get(key, 0)  # the engine's running totals, as counters
            if total > self.prefix_counted[key]:
                counter.inc(total - self.prefix_counted[key])
                self.prefix_counted[key] = total

    def finish(self, result: Result, reason: str) -> None:
        self.finished.labels(self.model, FINISH_REASONS[reason]).inc()
        if result.queue_s is not None:
            self.queue.observe(result.queue_s)
        self.request_generation.observe(result.generated_tokens)

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model, str(status)).inc()


class EngineLoop:
    """Owns the engine's thread: steps while there is work, sleeps when there is none, and hands each
    event to the asyncio queue of the HTTP request it belongs to."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, Submission, float]] = {}
        self._open: dict[str, set[int]] = {}  # each request's sequences that have not finished
        self._last_token: dict[tuple[str, int], float] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, ids: list[int], params: SamplingParams, submission: Submission) -> str:
        request_id = new_id("req")
        self._subscribers[request_id] = (asyncio.get_running_loop(), submission, time.perf_counter())
        self._open[request_id] = set(range(params.n))
        try:
            self.engine.add_request(ids, params, request_id)
        except Exception:
            self.forget(request_id)
            raise
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.request_prompt.observe(len(ids))
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def forget(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)
        self._open.pop(request_id, None)

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as exc:  # a bug of ours: fail what is in flight, keep serving
                traceback.print_exc()
                events = self._fail_everything(f"internal error: {type(exc).__name__}: {exc}")
            # Gauges first: a client that has its token and scrapes /metrics sees the step that made it.
            self.metrics.gauges(self.engine.stats())
            now = time.perf_counter()
            for event in events:
                self._deliver(event, now)

    def _deliver(self, event: Event, now: float) -> None:
        subscriber = self._subscribers.get(event.request_id)
        key = (event.request_id, event.sequence)
        if event.token_id is not None:
            self.metrics.generation_tokens.inc()
            last = self._last_token.get(key)
            if last is None and subscriber is not None:
                self.metrics.ttft.observe(now - subscriber[2])
            elif last is not None:
                self.metrics.itl.observe(now - last)
            self._last_token[key] = now
        if event.finish_reason is not None:
            self._last_token.pop(key, None)
            self._open.get(event.request_id, set()).discard(event.sequence)
            self.metrics.finish(event.result, event.finish_reason)
            if subscriber is not None:
                self.metrics.e2e.observe(now - subscriber[2])
        if subscriber is not None:
            loop, submission, _ = subscriber
            submission.delivered += 1
            if submission.too_far_behind(now) and not submission.overflowed:
                submission.overflowed = True  # the stream says why, if its client ever reads that far
                for request_id in list(submission.request_ids):
                    self.engine.abort(request_id)
                _say(f"aborted a stream whose client left more than {submission.stream_buffer} tokens unread")
            loop.call_soon_threadsafe(submission.queue.put_nowait, event)

    def _fail_everything(self, message: str) -> list[Event]:
        """Every sequence still open gets an error event, and the engine starts clean."""
        self.engine.fail_all(message)
        return [Event(request_id, None, "", "error", Result(error=message, finish_reason="error"), sequence)
                for request_id, sequences in list(self._open.items()) for sequence in sorted(sequences)]


@dataclass
class Submission:
    """One HTTP request's engine requests (one per prompt), each with n sequences, and their events.
    A stream has a bound on the events waiting for its reader (`stream_buffer`) while a write to its
    client is stuck; past it the engine thread aborts the requests (`overflowed`). Events wait for a
    fast client too, a step or two while the event loop catches up, which is not a reason to abort."""

    loop: EngineLoop
    n: int
    stream_buffer: int | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_ids: list[str] = field(default_factory=list)
    open_sequences: int = 0
    delivered: int = 0  # events handed over; written by the engine thread alone
    taken: int = 0  # events the reader took; written by the event loop alone
    write_started: float | None = None  # perf_counter when the write in progress began, if one is
    overflowed: bool = False

    def add(self, ids: list[int], params: SamplingParams) -> None:
        self.request_ids.append(self.loop.submit(ids, params, self))
        self.open_sequences += params.n

    def too_far_behind(self, now: float) -> bool:
        """Whether more than stream_buffer tokens per sequence wait behind a write that is stuck."""
        started = self.write_started
        return (self.stream_buffer is not None and started is not None and now - started > STUCK_WRITE_S
                and self.delivered - self.taken > self.stream_buffer * max(1, self.n * len(self.request_ids)))

    def choice_index(self, event: Event) -> int:
        return self.request_ids.index(event.request_id) * self.n + event.sequence

    async def events(self) -> AsyncIterator[Event]:
        while self.open_sequences:
            event = await self.queue.get()
            self.taken += 1
            if event.finish_reason is not None:
                self.open_sequences -= 1
            yield event

    def close(self) -> None:
        """Abort whatever has not finished (a client gone, an error elsewhere) and stop listening."""
        for request_id in self.request_ids:
            if self.open_sequences:
                self.loop.abort(request_id)
            self.loop.forget(request_id)


class Service:
    """The model behind the routes: loaded on a thread at startup, so /health can answer meanwhile."""

    def __init__(self, config: ServeConfig, selection: Selection) -> None:
        self.config, self.selection = config, selection
        self.artifact, self.entry = selection.artifact, selection.entry
        self.model = config.model_name or self.artifact.manifest.name
        self.metrics = Metrics(self.model)
        self.loop: EngineLoop | None = None
        self.engine: Engine | None = None
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        config = self.artifact.generation_config  # request fields left out take these, as vLLM does
        self.defaults = {key: config[key] for key in GENERATION_DEFAULTS if isinstance(config.get(key), int | float)}

    def load(self) -> None:
        """Open the backend, warm it up (a prefill and a decode step), then start the engine's thread."""
        from .generator import Generator
        from .memory import WARM_SLOTS_PER_ROW, host_kv_bytes_per_token, keep_freed_memory, warm_host_memory

        config = self.config
        model = self.selection.open(config.threads)
        # the prefill budget between decode steps holds: running requests keep streaming under a burst
        generator = Generator.of(model, config.max_batch_size, config.max_prefill_tokens, prefill_first=False,
                                 prefix_cache_mib=config.prefix_cache_mib)
        generator.engine.max_tokens_in_flight = config.max_tokens_in_flight
        generator.warmup()
        if keep_freed_memory():  # a burst's KV buffers (and their copies), faulted in once, not per burst
            slots = config.max_batch_size * WARM_SLOTS_PER_ROW
            if config.max_tokens_in_flight is not None:  # no more than admission lets requests hold
                slots = min(slots, config.max_tokens_in_flight)
            warm_host_memory(2 * slots * host_kv_bytes_per_token(model.backend))
        # Built now, not by the first request asking for an output format (on the event loop, for 0.3 s).
        unavailable = generator.engine.constraints.prepare()
        if unavailable:
            _say(f"{unavailable}; requests that ask for a format get a 400")
        self.engine = generator.engine
        self.loop = EngineLoop(self.engine, self.metrics)
        self.loop.start()
        self.ready = True

    def check(self, model: str) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="service_unavailable")
        if not self.ready:
            raise ApiError(503, "the model is still loading; retry when GET /health answers 200",
                           kind="service_unavailable")
        if model != self.model:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model}'", "model",
                           "model_not_found")

    def encode(self, prompt: Any, param: str) -> list[int]:
        try:
            return self.engine.encode(prompt)
        except ValueError as exc:  # a chat template's own check, a template that is missing
            raise ApiError(400, str(exc), param) from None

    def admit(self, submission: Submission, prompts: list[list[int]], body: Any, param: str) -> None:
        """Sampling params for each prompt, then the queue check, then all of them into the engine."""
        max_context = self.engine.max_context
        params = [body.sampling_params(len(ids), max_context, self.defaults) for ids in prompts]
        stats = self.engine.stats()  # the queue is what waits beyond the rows free now
        free_rows = max(0, self.engine.max_batch_size - stats["running"])
        if stats["waiting"] + len(prompts) > self.config.max_queue + free_rows:
            raise ApiError(429, f"the queue is full ({self.config.max_queue} requests waiting); retry shortly",
                           kind="rate_limit_error", code="queue_full")
        try:
            for ids, p in zip(prompts, params, strict=True):
                submission.add(ids, p)
        except RequestError as exc:
            submission.close()
            raise ApiError(400, str(exc), param) from None


# A write this long waits for its client to read (the socket is full), not for the event loop.
STUCK_WRITE_S = 0.25

MAX_BODY_BYTES = 10 * 2**20  # a request body past this is refused (413) before it is read whole or parsed


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413 in OpenAI's error shape, said from its
    Content-Length before a byte of it is read, or as soon as a body without one (chunked) passes the
    limit; at most `limit` bytes are ever held."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES, on_refuse: Any = None) -> None:
        self.app, self.limit, self.on_refuse = app, limit, on_refuse  # on_refuse(status): the metrics' count

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send, int(length))
        if length is not None:
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:  # no length given: read it here, up to the limit, then hand it on
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message)
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._refuse(send, None)
        return await self.app(scope, _replay(chunks, receive), send)

    async def _refuse(self, send: Any, length: int | None) -> None:
        said = f"{length:,} bytes" if length is not None else "more than that"
        error = ApiError(413, f"the request body is {said}; this server takes at most {self.limit:,} bytes",
                         kind="invalid_request_error")
        if self.on_refuse is not None:
            self.on_refuse(413)
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], then: Any = None) -> Any:
    """A receive() that gives these messages first, then the real receive's (a disconnect, say)."""
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        return await then() if then is not None else {"type": "http.disconnect"}

    return receive


def create_app(service: Service) -> Any:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        service.draining = True
        if service.loop is not None:
            service.loop.close()

    app = FastAPI(title="Kiln", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, on_refuse=service.metrics.reject)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        service.metrics.reject(exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, validation_error(exc.errors()))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # logged by uvicorn too
        return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                 kind="internal_error"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return await api_error(request, ApiError(exc.status_code, str(exc.detail), kind="invalid_request_error"))

    def authorize(request: Request) -> None:
        key = service.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        if service.ready and not service.draining:
            return JSONResponse({"status": "ok"})
        state = "draining" if service.draining else "failed" if service.load_error else "loading"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        card = {"id": service.model, "object": "model", "created": int(service.artifact.folder.stat().st_mtime),
                "owned_by": "kiln", "max_model_len": service.artifact.manifest.model.max_context}
        return JSONResponse({"object": "list", "data": [card]})

    async def answer(body: Any, request: Request, shape: _Shape) -> Response:
        authorize(request)
        service.check(body.model)
        body.refuse_unsupported()
        return await _answer(service, request, body, shape)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await answer(body, request, _COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await answer(body, request, _CHAT)

    return app


class _ClientStalled(Exception):
    """A write waited longer than the write timeout for its client to take bytes."""


class _ClosingStream(StreamingResponse):
    """A stream whose submission is closed however the response ends: a client that is gone before
    the first chunk never starts the body's generator, whose own `finally` would then never run. A
    write that waits `write_timeout` seconds for its client to take bytes aborts the connection:
    what the kernel and the transport hold for it is dropped (a plain close would wait for the
    client to read it, which a silent client never does)."""

    def __init__(self, submission: Submission, write_timeout: float, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.submission, self.write_timeout = submission, write_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_in_time(message: Any) -> None:
            self.submission.write_started = time.perf_counter()
            try:
                async with asyncio.timeout(self.write_timeout):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None
            finally:
                self.submission.write_started = None

        try:
            await super().__call__(scope, receive, send_in_time)
        except _ClientStalled:
            abort = scope.get("kiln.abort_connection")
            if abort is not None:  # else uvicorn closes it when the response returns unfinished
                abort()
                await asyncio.sleep(0)  # uvicorn hears of the lost connection before the return
            _say(f"closed a stream whose client took no bytes for {self.write_timeout:g} s")
        finally:
            self.submission.close()


@dataclass(frozen=True)
class _Shape:
    """What differs between the completions and the chat completions answer."""

    prefix: str
    kind: str
    chunk_kind: str
    chat: bool


_COMPLETION = _Shape("cmpl", "text_completion", "text_completion", chat=False)
_CHAT = _Shape("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


async def _answer(service: Service, request: Any, body: Any, shape: _Shape) -> Any:
    texts, param = request_prompts(body)
    prompts = [service.encode(text, param) for text in texts]
    submission = Submission(service.loop, body.n, service.config.stream_buffer if body.stream else None)
    service.admit(submission, prompts, body, param)
    response_id = new_id(shape.prefix)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(service, submission, shape, response_id, prompts, body.n, include_usage)
        return _ClosingStream(submission, service.config.write_timeout, chunks, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache"})
    results = await _collect_or_abort(submission, request)
    if results is None:  # the client went away; nobody reads this
        return JSONResponse({}, status_code=499)
    failed = next((r for r in results.values() if r.finish_reason == "error"), None)
    if failed is not None:
        raise ApiError(500, f"generation failed: {failed.error}", kind="internal_error")
    return JSONResponse(response_body(shape.chat, service.model, results, prompts,
                                      service.engine.tokenizer, fingerprint(service.entry), response_id))


async def _collect_or_abort(submission: Submission, request: Any) -> dict[int, Result] | None:
    """Every sequence's result, by choice index; None if the client disconnected first (then aborted)."""

    async def collect() -> dict[int, Result]:
        results = {}
        async for event in submission.events():
            if event.result is not None:
                results[submission.choice_index(event)] = event.result
                if event.finish_reason == "error":
                    break
        return results

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting, watching = asyncio.create_task(collect()), asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        return collecting.result() if collecting in done else None
    finally:
        for task in (collecting, watching):
            task.cancel()
        submission.close()


async def _stream(service: Service, submission: Submission, shape: _Shape, response_id: str,
                  prompts: list[list[int]], n: int, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events as the OpenAI API sends them: a chunk per new piece of text, the finish
    reason once per choice, the usage chunk when asked for, then [DONE]. Closing the generator (the
    client went away) aborts the requests."""
    created, tokenizer = int(time.time()), service.engine.tokenizer
    extra = {"usage": None} if include_usage else {}
    system_fingerprint = fingerprint(service.entry)

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        body = envelope(shape.chunk_kind, response_id, service.model, choices, created,
                        system_fingerprint=system_fingerprint, **{**extra, **more})
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    completion_tokens, cached_tokens, offsets = 0, 0, {}  # offsets: each choice's text so far (text_offset)
    try:
        if shape.chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(prompts) * n)])
        async for event in submission.events():
            if event.finish_reason == "error":
                error = ApiError(500, f"generation failed: {event.result.error}", kind="internal_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            if submission.overflowed and event.finish_reason == "abort":
                error = ApiError(400, f"the client read this stream too slowly: more than "
                                 f"{submission.stream_buffer} tokens waited to be sent, so it was aborted",
                                 code="stream_buffer_full")
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            if event.result is not None:
                completion_tokens += event.result.generated_tokens
                if event.sequence == 0:  # a prompt's cached tokens, once however many choices it has
                    cached_tokens += event.result.cached_tokens
            if not (event.text or event.logprob or event.finish_reason):
                continue
            index = submission.choice_index(event)
            finish = FINISH_REASONS[event.finish_reason] if event.finish_reason else None
            logprobs = [event.logprob] if event.logprob else []
            if shape.chat:
                choice = {"index": index, "delta": {"content": event.text} if event.text else {},
                          "logprobs": chat_logprobs(tokenizer, logprobs) if logprobs else None,
                          "finish_reason": finish}
            else:
                offset = offsets.get(index, 0)
                choice = {"index": index, "text": event.text,
                          "logprobs": completion_logprobs(tokenizer, logprobs, offset) if logprobs else None,
                          "finish_reason": finish}
                offsets[index] = offset + sum(len(tokenizer.token_text(t.token_id)) for t in logprobs)
            yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage(sum(map(len, prompts)), completion_tokens, cached_tokens))
        yield "data: [DONE]\n\n"
    finally:
        submission.close()


def memory_budgets(manifest: Manifest, entry: Variant, config: ServeConfig) -> tuple[int | None, float]:
    """KV slots the running requests may reserve, and the prefix cache's MiB, from the memory plan and
    this host's free memory: the prefix cache's share is not the running requests'. Refuses
    (IncompatibleArtifact) a host that cannot hold even one sequence at the max context."""
    from .memory import MIB, free_host_memory, prefix_cache_default, require_fit, tokens_in_flight

    one = require_fit(manifest, entry, 1, providers_for(config.device), prefill_tokens=config.max_prefill_tokens)
    if one is None:  # an engine's memory is the GPU's: bounded by its profiles instead (no prefix cache)
        return None, 0 if config.prefix_cache_mib is None else config.prefix_cache_mib
    free = free_host_memory()
    prefix_mib = config.prefix_cache_mib if config.prefix_cache_mib is not None else prefix_cache_default(
        one.kv_bytes_per_token, config.max_batch_size, manifest.model.max_context, free) / MIB
    slots = tokens_in_flight(one, free + one.baseline_bytes - int(prefix_mib * MIB))
    if slots < one.context and config.prefix_cache_mib is None:  # a tight host: the default gives way
        prefix_mib, slots = 0, tokens_in_flight(one, free + one.baseline_bytes)
    if slots < one.context and prefix_mib:
        from .errors import IncompatibleArtifact

        raise IncompatibleArtifact(f"--prefix-cache-mib {prefix_mib:g} leaves this host's free memory no room for "
                                   f"one sequence at the max context ({one.context} tokens); lower it")
    return slots, prefix_mib


def serve(config: ServeConfig) -> int:
    """Run the server until SIGTERM or Ctrl-C; returns the exit code. Raises KilnError for a bad artifact
    or variant before anything listens."""
    import socket

    import uvicorn

    from .memory import keep_freed_memory
    from .model import select_variant

    keep_freed_memory()  # before any thread has an allocator arena of its own (Service.load warms the pages)
    selection = select_variant(config.artifact, config.variant, providers_for(config.device), verify=config.verify)
    if config.max_tokens_in_flight is None:  # else the generator sizes a default prefix cache itself
        budget, prefix_mib = memory_budgets(selection.artifact.manifest, selection.entry, config)
        config = dataclasses.replace(config, max_tokens_in_flight=budget, prefix_cache_mib=prefix_mib)
    service = Service(config, selection)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if config.send_buffer_bytes:  # accepted connections inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.send_buffer_bytes)
    try:
        listener.bind((config.host, config.port))
    except OSError as exc:
        listener.close()
        from .errors import KilnError

        raise KilnError(f"cannot listen on {config.host}:{config.port}: {exc.strerror}") from None
    port = listener.getsockname()[1]
    app = _with_connection_abort(create_app(service))
    server = _draining_server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                             timeout_graceful_shutdown=config.drain_timeout), service)
    host = f"[{config.host}]" if family == socket.AF_INET6 else config.host
    _say(f"http://{host}:{port}/v1  model {service.model}  variant {selection.name}  "
         f"max batch {config.max_batch_size}  max queue {config.max_queue}  "
         f"prefill budget {config.max_prefill_tokens} tokens/step  "
         + (f"KV slots in flight {config.max_tokens_in_flight:,}  " if config.max_tokens_in_flight else "")
         + (f"prefix cache {config.prefix_cache_mib:,.0f} MiB  " if config.prefix_cache_mib is not None else "")
         + f"max context {selection.artifact.manifest.model.max_context}  "
         f"threads {config.threads or 'all cores'}  api key {'required' if config.api_key else 'not required'}")
    loader = threading.Thread(target=_load, args=(service, server), name="kiln-load", daemon=True)
    loader.start()
    server.run(sockets=[listener])
    if service.load_error:
        return 1
    _say("stopped")
    return 0


def _with_connection_abort(app: Any) -> Any:
    """The app, with each HTTP request's scope holding `kiln.abort_connection`: uvicorn's send is a
    method of the request's cycle, whose transport's abort() closes the connection at once."""

    async def outer(scope: Any, receive: Any, send: Any) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and transport is not None:
            scope["kiln.abort_connection"] = transport.abort
        await app(scope, receive, send)

    return outer


def _load(service: Service, server: Any) -> None:
    started = time.perf_counter()
    try:
        service.load()
    except Exception as exc:  # noqa: BLE001 - one line, then the server stops with exit code 1
        from .errors import KilnError

        service.load_error = str(exc) if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
        _say(f"error: loading the model failed: {service.load_error}")
        server.should_exit = True
        return
    engine = service.engine
    # Worth a word: batch-1 steps are slower for it (runtime/backends/onnxruntime.py, lone rows).
    lone = (", a lone sequence decodes beside a spare row: this CPU's kernels compute one row unlike several"
            if getattr(engine.backend, "min_rows", 1) > 1 else "")
    _say(f"ready in {time.perf_counter() - started:.1f} s (max context {engine.max_context}, "
         f"max batch {engine.max_batch_size}{lone})")


def _say(line: str) -> None:
    print(f"kiln serve: {line}", flush=True)


def _draining_server(config: Any, service: Service) -> Any:
    """uvicorn's Server, which also says when it starts to drain and stops admitting at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                running = service.engine.stats()["running"] if service.engine else 0
                _say(f"{signal.Signals(sig).name}: draining {running} running sequences "
                     f"(up to {service.config.drain_timeout:g} s), not admitting new requests")
            service.draining = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after its shutdown, which would end the process as
            # killed by it; a drained server exits 0 instead.
            self._captured_signals.clear()

    return Server(config)
