"""kiln batch: bulk offline inference over JSONL, resumable, on one machine or over a Ray cluster.

    INPUT.jsonl ─scan: format, row count, ids (duplicates refused up front)─┐
    OUTPUT.jsonl ─ids already answered (a torn last line trimmed)───────────┴─> rows still to do
      ─> chunks of `chunk_rows` rows ─parse and check (a bad row -> ERRORS.jsonl)─> sorted by prompt length
      ─> Engine (continuous batching: the next chunk is queued while the last one decodes)
      ─> output lines appended as rows finish; OUTPUT and ERRORS flushed and fsynced every chunk

Two input formats, detected per file from its first row: the OpenAI Batch API's request line
({"custom_id", "method", "url", "body"}), answered with its output line whose body is what `kiln
serve` returns for that request (openai_api.py builds both), and a simple line ({"id", "prompt" |
"messages", <sampling fields>}), answered with {"id", "text", "finish_reason", "usage"}.

Output order: rows are written as they finish, not in input order (OpenAI's Batch API does the
same); each line carries its id and resume is keyed by it. Input order would hold every finished
row back behind the slowest row of its chunk, and a kill would lose all of them.

With Ray (`--ray`), Ray Data reads INPUT and an actor pool of `workers` runtimes answers it (one
Answerer per actor); the driver writes OUTPUT exactly as the local path does, so resume, errors
and the summary are the same code.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from pathlib import Path
from typing import Any, TextIO

from pydantic import ConfigDict, ValidationError

from .device import providers_for
from .engine import RequestError, Result
from .errors import KilnError
from .openai_api import (
    GENERATION_DEFAULTS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    fingerprint,
    request_prompts,
    response_body,
    validation_error,
    with_defaults,
)

OPENAI, SIMPLE = "openai", "simple"
OPENAI_URLS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
SYNC_SECONDS = 5.0  # OUTPUT is also fsynced this often when chunks are slow


class SimpleCompletion(CompletionRequest):
    model_config = ConfigDict(extra="forbid")  # a misspelt sampling field in our own format is an error


class SimpleChat(ChatCompletionRequest):
    model_config = ConfigDict(extra="forbid")


@dataclass
class BatchConfig:
    artifact: Path
    input: Path
    output: Path
    variant: str | None = None
    errors: Path | None = None  # default: OUTPUT's name with .errors.jsonl
    max_batch_size: int = 32
    max_prefill_tokens: int = 512
    threads: int | None = None
    chunk_rows: int = 1024
    resume: bool = True
    defaults: dict[str, Any] = field(default_factory=dict)  # sampling fields a row leaves out
    ray: bool = False
    ray_address: str | None = None  # None: RAY_ADDRESS, else a local instance
    workers: int = 1
    verify: bool = True
    model_name: str | None = None
    device: str | None = None  # cpu, cuda, cuda:N or auto (runtime/device.py)
    prefix_cache_mib: float | None = None  # each runtime's (each Ray worker's) own; None: the default, 0: off

    @property
    def errors_path(self) -> Path:
        return self.errors or self.output.with_name(self.output.name.removesuffix(".jsonl") + ".errors.jsonl")


class RowError(Exception):
    """What is wrong with one row: it goes to ERRORS with this message; the job goes on."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None,
                 status: int | None = 400) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.status = status  # the HTTP status kiln serve would answer; None: the line is no request at all


@dataclass
class Answer:
    """One row's outcome: the line for OUTPUT (ok) or for ERRORS (not ok)."""

    id: Any
    line: int | None  # in INPUT; a Ray worker does not know it, the driver fills it in
    ok: bool
    record: dict[str, Any]
    completion_tokens: int = 0


# -- rows -----------------------------------------------------------------------------------------

def row_id(obj: dict[str, Any], fmt: str) -> Any:
    """The row's id (custom_id for OpenAI Batch lines); RowError when it is missing or not usable."""
    key = "custom_id" if fmt == OPENAI else "id"
    value = obj.get(key)
    if value is None:
        raise RowError(f'no "{key}": every row needs a unique one (output lines and resume are keyed by it)',
                       "missing_id", key, None)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RowError(f'"{key}" must be a string or an integer, got {json.dumps(value)[:80]}', "invalid_id", key,
                       None)
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (\ud800): no UTF-8 output line could carry it
            raise RowError(f'"{key}" is not valid Unicode text', "invalid_id", key, None) from None
    return value


def parse_line(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if raw is None:
        raise RowError("not UTF-8 text; JSON Lines files are UTF-8", "invalid_encoding", status=None)
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RowError(f"not valid JSON ({exc.msg} at column {exc.colno})", "invalid_json", status=None) from None
    except (ValueError, RecursionError) as exc:  # a number past Python's digit limit, nesting too deep
        raise RowError(f"not usable JSON ({str(exc)[:100]})", "invalid_json", status=None) from None
    if not isinstance(obj, dict):
        raise RowError(f"a row must be a JSON object, got {type(obj).__name__}", "invalid_json", status=None)
    return obj


def detect_format(obj: dict[str, Any]) -> str:
    return OPENAI if "custom_id" in obj or "body" in obj else SIMPLE


@dataclass
class Scan:
    """What one pass over INPUT found: its format, its row count, and each id's line."""

    format: str
    rows: int
    lines: dict[Any, int]
    unreadable: list[tuple[int, RowError]]  # rows with no usable id: they are reported, never answered
    # The first line that Ray Data's reader would split in two (it splits at \r, U+2028 and other
    # line breaks too, where JSON Lines splits at \n only), or None.
    ray_split_line: int | None = None


def scan_input(path: Path, fmt: str | None = None) -> Scan:
    """Raises KilnError for an input with duplicate ids (with their line numbers) or no rows."""
    lines: dict[Any, int] = {}
    duplicates: list[str] = []
    unreadable: list[tuple[int, RowError]] = []
    rows, ray_split_line = 0, None
    for number, raw in _numbered_lines(path):
        rows += 1
        if ray_split_line is None and raw is not None and len(raw.splitlines()) > 1:
            ray_split_line = number
        try:
            obj = parse_line(raw)
            fmt = fmt or detect_format(obj)
            key = row_id(obj, fmt)
        except RowError as exc:
            unreadable.append((number, exc))
            continue
        if key in lines:
            duplicates.append(f"{json.dumps(key)} on lines {lines[key]} and {number}")
        else:
            lines[key] = number
    if duplicates:
        more = f" (and {len(duplicates) - 5} more)" if len(duplicates) > 5 else ""
        raise KilnError(f"{path} has duplicate ids: {'; '.join(duplicates[:5])}{more}; ids must be unique")
    if rows == 0:
        raise KilnError(f"{path} has no rows; give one JSON object per line")
    return Scan(fmt or SIMPLE, rows, lines, unreadable, ray_split_line)


def _numbered_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """Non-blank lines with their 1-based numbers, split at "\n" only, as JSON Lines says (a JSON
    string may hold a raw U+2028); None for a line that is not UTF-8."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            if raw.strip():
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield number, None


# -- answering rows through one engine ----------------------------------------------------------

@dataclass
class _Row:
    id: Any
    line: int | None
    request: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    n: int
    params: list[Any] | None  # until its prompts are in the engine
    results: dict[int, Result] = field(default_factory=dict)


class Answerer:
    """Rows in, answers out, through one engine: the local job's and each Ray worker's core."""

    def __init__(self, generator: Any, fmt: str, system_fingerprint: str, model_name: str | None = None,
                 defaults: dict[str, Any] | None = None, chunk_rows: int = 1024) -> None:
        self.engine, self.format, self.chunk_rows = generator.engine, fmt, chunk_rows
        artifact = generator.artifact
        self.model = model_name or artifact.manifest.name
        self.fingerprint = system_fingerprint
        self.defaults = dict(defaults or {})  # the command line's: a row's own fields win
        config = artifact.generation_config  # then the artifact's, as `kiln serve` does
        self.generation_defaults = {key: config[key] for key in GENERATION_DEFAULTS
                                    if isinstance(config.get(key), int | float)}

    @classmethod
    def load(cls, config: BatchConfig, fmt: str) -> Answerer:
        from .generator import Generator
        from .model import open_model

        model = open_model(config.artifact, config.variant, providers_for(config.device), threads=config.threads,
                           verify=config.verify,
                           max_batch_size=config.max_batch_size, max_prefill_tokens=config.max_prefill_tokens)
        generator = Generator.of(model, config.max_batch_size, config.max_prefill_tokens,
                                 prefix_cache_mib=config.prefix_cache_mib)
        return cls(generator, fmt, fingerprint(model.entry), config.model_name, config.defaults, config.chunk_rows)

    def answer(self, rows: Iterable[tuple[int | None, str | dict[str, Any]]]) -> Iterator[Answer]:
        """Answers in the order rows finish. A chunk is read when the engine's queue runs low, so the
        batch stays full across chunks and memory stays bounded by a few chunks."""
        source, exhausted = iter(rows), False
        pending: dict[int, _Row] = {}
        keys = iter(range(1 << 62))
        engine = self.engine
        while True:
            if not exhausted and engine.stats()["waiting"] < engine.max_batch_size:
                chunk = list(islice(source, self.chunk_rows))
                exhausted = len(chunk) < self.chunk_rows
                ready = []
                for line, raw in chunk:
                    try:
                        ready.append(self.prepare(line, raw))
                    except RowError as exc:
                        yield self.failure(line, raw, exc)
                for row in sorted(ready, key=lambda r: max(map(len, r.prompts))):
                    key = next(keys)
                    pending[key] = row
                    for index, (ids, params) in enumerate(zip(row.prompts, row.params, strict=True)):
                        engine.add_request(ids, params, (key, index))
                    row.params = None
                if not exhausted:
                    continue
            if not engine.has_work():
                if exhausted:
                    return
                continue
            for event in engine.step():
                if event.result is None:
                    continue
                key, index = event.request_id
                row = pending[key]
                row.results[index * row.n + event.sequence] = event.result
                if len(row.results) == len(row.prompts) * row.n:
                    del pending[key]
                    yield self.success(row)

    def prepare(self, line: int | None, raw: str | dict[str, Any]) -> _Row:
        """The row parsed, validated, encoded and given its sampling params; RowError says what is wrong."""
        obj = parse_line(raw)
        key = row_id(obj, self.format)
        if self.format == OPENAI:
            if obj.get("method", "POST") != "POST":
                raise RowError(f'method must be "POST", got {json.dumps(obj.get("method"))}', "invalid_method",
                               "method")
            url = obj.get("url")
            if url not in OPENAI_URLS:
                raise RowError(f"url {json.dumps(url)} is not supported; use one of {', '.join(OPENAI_URLS)}",
                               "invalid_url", "url")
            body = obj.get("body")
            if not isinstance(body, dict):
                raise RowError('"body" must be a JSON object: the request, as it would be POSTed to url',
                               "invalid_body", "body")
            kind, fields = OPENAI_URLS[url], {"model": self.model, **with_defaults(self.defaults, body)}
        else:
            if "custom_id" in obj or "body" in obj:
                raise RowError("an OpenAI Batch line in a file of simple rows (detected from its first row); "
                               "keep one format per file", "mixed_formats", status=None)
            fields = {key: value for key, value in obj.items() if key != "id"}
            if "messages" in fields:
                kind = SimpleChat
            elif "prompt" in fields:
                kind = SimpleCompletion
            else:
                raise RowError('no prompt: give "prompt" (a string) or "messages" (a chat)', "missing_prompt",
                               "prompt")
            fields = {**with_defaults(self.defaults, fields), "model": self.model}
        try:
            request = kind.model_validate(fields)
            request.refuse_unsupported()
            prompts, param = request_prompts(request)
            encoded = [self._encode(prompt, param) for prompt in prompts]
            max_context = self.engine.max_context
            params = [request.sampling_params(len(ids), max_context, self.generation_defaults) for ids in encoded]
            for ids, p in zip(encoded, params, strict=True):
                self.engine.checked_prompt(ids, p)
        except ValidationError as exc:
            error = validation_error(exc.errors())
            raise RowError(error.message, error.code, error.param, error.status) from None
        except ApiError as exc:
            raise RowError(exc.message, exc.code or "invalid_request", exc.param, exc.status) from None
        except RequestError as exc:
            raise RowError(str(exc), "invalid_request") from None
        return _Row(key, line, request, encoded, request.n, params)

    def _encode(self, prompt: Any, param: str) -> list[int]:
        try:
            return self.engine.encode(prompt)
        except ValueError as exc:  # a chat template's own check, a template that is missing
            raise ApiError(400, str(exc), param) from None

    def success(self, row: _Row) -> Answer:
        failed = next((r for r in row.results.values() if r.finish_reason == "error"), None)
        if failed is not None:
            return self.failure(row.line, None, RowError(f"generation failed: {failed.error}", "internal_error",
                                                         status=500), row.id)
        chat = isinstance(row.request, ChatCompletionRequest)
        body = response_body(chat, self.model, row.results, row.prompts, self.engine.tokenizer,
                             self.fingerprint)
        tokens = body["usage"]["completion_tokens"]
        if self.format == OPENAI:
            record = {"id": _new_id("batch_req"), "custom_id": row.id,
                      "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
                      "error": None}
        else:
            choices = [{"index": c["index"], "text": c["message"]["content"] if chat else c["text"],
                        "finish_reason": c["finish_reason"], **({"logprobs": c["logprobs"]} if c["logprobs"] else {})}
                       for c in body["choices"]]
            record = {"id": row.id, **{k: v for k, v in choices[0].items() if k != "index"}, "usage": body["usage"],
                      "error": None}
            if len(choices) > 1:
                record["choices"] = choices
        return Answer(row.id, row.line, True, record, tokens)

    def failure(self, line: int | None, raw: Any, error: RowError, key: Any = None) -> Answer:
        if key is None and raw is not None:
            try:
                key = row_id(parse_line(raw), self.format)
            except RowError:
                pass
        return failed_answer(self.format, line, key, error)


def failed_answer(fmt: str, line: int | None, key: Any, error: RowError) -> Answer:
    """A row's line for ERRORS: OpenAI Batch's error line (the body `kiln serve` would have answered
    with) for that format, {"id", "error"} for simple rows; the job adds "line"."""
    if fmt == OPENAI and error.status is not None:  # a request that was answered with an error status
        body = {"error": {"message": error.message, "type": "invalid_request_error" if error.status < 500
                          else "internal_error", "param": error.param, "code": error.code}}
        record = {"id": _new_id("batch_req"), "custom_id": key,
                  "response": {"status_code": error.status, "request_id": uuid.uuid4().hex, "body": body},
                  "error": None}
    elif fmt == OPENAI:  # a line that is no request: OpenAI's form for a request never sent
        record = {"id": _new_id("batch_req"), "custom_id": key, "response": None,
                  "error": {"code": error.code, "message": error.message}}
    else:
        record = {"id": key, "error": {"code": error.code, "message": error.message, "param": error.param}}
    return Answer(key, line, False, record)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the Python API -------------------------------------------------------------------------------

def run(artifact: str | Path, rows: Iterable[str | dict[str, Any]], *, variant: str | None = None,
        max_batch_size: int = 32, threads: int | None = None, defaults: dict[str, Any] | None = None,
        chunk_rows: int = 1024, verify: bool = True, prefix_cache_mib: float | None = None
        ) -> Iterator[dict[str, Any]]:
    """Answer rows (dicts or JSON lines, in one format) with the artifact: yields each row's output
    line as `kiln batch` writes it, in the order rows finish; a failed row's line has "error" set.

        for line in batch.run("out/smollm2", [{"id": 1, "prompt": "Hi", "max_tokens": 8}]):
            print(line["id"], line["text"])
    """
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        return
    try:
        fmt = detect_format(parse_line(first))
    except RowError:
        fmt = SIMPLE
    config = BatchConfig(Path(artifact), input=Path(), output=Path(), variant=variant,  # no files here
                         max_batch_size=max_batch_size, threads=threads, chunk_rows=chunk_rows,
                         defaults=dict(defaults or {}), verify=verify, prefix_cache_mib=prefix_cache_mib)
    numbered = enumerate(chain([first], rows), 1)
    for answer in Answerer.load(config, fmt).answer(numbered):
        yield answer.record if answer.ok else {**answer.record, "line": answer.line}


# -- the job: files, resume, progress -----------------------------------------------------------

@dataclass
class Summary:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def answered_ids(path: Path, fmt: str) -> tuple[set[Any], int]:
    """The ids OUTPUT already holds, and how many bytes of a torn last line were trimmed off it.

    A kill -9 can leave a last line without its newline (never a complete line that is wrong): it is
    cut off, and its row is answered again. A broken line before the last is not kiln's: refused."""
    key = "custom_id" if fmt == OPENAI else "id"
    ids: set[Any] = set()
    good_end = 0
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.endswith(b"\n"):
                break  # torn: trimmed below
            try:
                ids.add(json.loads(raw)[key])
            except (ValueError, KeyError, TypeError):
                raise KilnError(f"{path} line {number} is not a line kiln batch wrote for this input; move "
                                f"{path} away, or pass --no-resume to start over") from None
            good_end += len(raw)
    size = path.stat().st_size
    if size > good_end:
        with open(path, "r+b") as output:
            output.truncate(good_end)
            os.fsync(output.fileno())
    return ids, size - good_end


class _Sink:
    """An append-only JSONL file. Records are held until sync(), which writes them whole, then flushes and
    fsyncs: what is on disk is always whole lines. A write the disk refuses (full, read-only, or the file
    removed meanwhile) cuts the file back to its last whole line, and is one KilnError naming the file
    and what is wrong; the rows it held are answered again on resume."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        self.file = open(path, mode + "b", buffering=0)  # noqa: SIM115 - closed by close()
        self.pending: list[bytes] = []
        self.failed = False

    def write(self, record: dict[str, Any]) -> None:
        self.pending.append((json.dumps(record, ensure_ascii=False) + "\n").encode())

    def sync(self) -> None:
        if self.failed:
            return
        data, self.pending = b"".join(self.pending), []
        descriptor = self.file.fileno()
        whole = os.lseek(descriptor, 0, os.SEEK_END)
        try:
            if os.fstat(descriptor).st_nlink == 0:
                raise FileNotFoundError(2, "removed while the job ran")
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view):]
            os.fsync(descriptor)
        except OSError as exc:
            self.failed = True
            why = self._why(exc, len(data))  # the free space before the cut gives some back
            with contextlib.suppress(OSError):
                os.ftruncate(descriptor, whole)  # no torn line: the file ends where the last sync left it
            raise KilnError(why) from None

    def _why(self, exc: OSError, size: int) -> str:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            with contextlib.suppress(OSError):
                reason += (f" for {size:,} bytes of answers ({shutil.disk_usage(self.path.parent).free:,} bytes "
                           "free there)")
        return (f"cannot write {self.path}: {reason}; what finished before is in it, whole: make room (or put "
                "the file back) and rerun the same command to resume")

    def close(self) -> None:
        try:
            self.sync()
        finally:
            self.file.close()


class Progress:
    """Rows done / total, rows/s, output tokens/s and ETA: one rewritten line on a terminal, a plain
    line every `every` seconds otherwise (a log file, CI)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, every: float = 10.0) -> None:
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.every = 0.2 if self.tty else every
        self.started = self.last = time.perf_counter()

    def show(self, summary: Summary, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.every:
            return
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        rows = summary.done + summary.failed
        rate, tokens = rows / elapsed, summary.completion_tokens / elapsed
        left = self.total - rows
        eta = _duration(left / rate) if rate > 0 and left > 0 else "-"
        percent = 100.0 * rows / self.total if self.total else 100.0
        text = (f"rows {rows:,}/{self.total:,} ({percent:.0f}%) · {summary.failed:,} failed · {rate:.1f} rows/s · "
                f"{tokens:,.0f} tok/s · ETA {eta}")
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        elif not final:
            self.stream.write(f"kiln batch: {text}\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def check_paths(config: BatchConfig) -> None:
    """Before anything loads: KilnError for paths that would lose or clobber data."""
    paths = {"INPUT": config.input.resolve(), "OUTPUT": config.output.resolve(),
             "ERRORS": config.errors_path.resolve()}
    if len(set(paths.values())) < 3:
        raise KilnError("INPUT, OUTPUT and ERRORS must be three different files "
                        f"(got {', '.join(f'{k}={v}' for k, v in paths.items())})")
    for name in ("OUTPUT", "ERRORS"):
        path = paths[name]
        if path.is_dir():
            raise KilnError(f"{name} {path} is a folder; give a file name")
        if not path.parent.is_dir():
            raise KilnError(f"{name}'s folder {path.parent} does not exist; create it first")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise KilnError(f"{name} {path} is not writable")


def run_job(config: BatchConfig, progress_stream: TextIO = sys.stderr, progress_every: float = 10.0) -> Summary:
    """The whole job. KilnError for a bad command line, input or artifact, raised before OUTPUT or
    ERRORS is touched: the model is loaded (or Ray found) first."""
    check_paths(config)
    try:
        scan = scan_input(config.input)
    except OSError as exc:
        raise KilnError(f"cannot read INPUT {config.input}: {exc.strerror or exc}") from None
    answerer = None if config.ray else _load_answerer(config, scan.format)
    gpus = 0
    if config.ray:
        _import_ray()
        from .backends.registry import memory_on_host
        from .model import select_variant

        # one variant for every worker, named here: each worker's own default could differ with its host
        selection = select_variant(config.artifact, config.variant, providers_for(config.device), verify=False)
        config = replace(config, variant=selection.name)
        gpus = 0 if memory_on_host(selection.entry, providers_for(config.device)) else 1
        undecodable = next((line for line, error in scan.unreadable if error.code == "invalid_encoding"), None)
        if undecodable is not None:  # Ray Data's read_text fails on the whole file for one such line
            raise KilnError(f"INPUT line {undecodable} is not UTF-8, and Ray Data cannot read such a file; fix "
                            "the line, or run without --ray (it reports the line and goes on)")
        if scan.ray_split_line is not None:
            raise KilnError(f"INPUT line {scan.ray_split_line} holds a line break other than \\n (\\r, U+2028, ...), "
                            "where Ray Data's reader would split it in two; remove it, or run without --ray")
    output = _Sink(config.output, "a")
    try:
        done = _claim_output(output, config, scan.format, progress_stream)
        errors = _Sink(config.errors_path, "w")  # this run's errors: failed rows are tried again on resume
    except BaseException:
        output.close()
        raise
    summary = Summary(skipped=sum(1 for key in scan.lines if key in done))
    progress = Progress(scan.rows - summary.skipped, progress_stream, progress_every)
    started, synced, since_sync = time.perf_counter(), time.perf_counter(), 0
    finished = False
    try:
        for line, error in scan.unreadable:
            _record(errors, summary, failed_answer(scan.format, line, None, error), scan)
        answers = (_ray_answers(config, scan, done, gpus) if answerer is None else
                   _local_answers(answerer, config, scan, done))
        for answer in answers:
            _record(output if answer.ok else errors, summary, answer, scan)
            since_sync += 1
            if since_sync >= config.chunk_rows or time.perf_counter() - synced > SYNC_SECONDS:
                output.sync()
                errors.sync()
                synced, since_sync = time.perf_counter(), 0
            progress.show(summary)
        finished = True
    finally:
        _close(output, errors, quietly=not finished)  # a failure already on its way is the one to say
        summary.seconds = time.perf_counter() - started
        progress.show(summary, final=True)
    return summary


def _close(*sinks: _Sink, quietly: bool) -> None:
    """Sync and close every sink; the first that cannot be written is raised, unless `quietly`."""
    failure = None
    for sink in sinks:
        try:
            sink.close()
        except KilnError as exc:
            failure = failure or exc
    if failure is not None and not quietly:
        raise failure


def _load_answerer(config: BatchConfig, fmt: str) -> Answerer:
    try:
        return Answerer.load(config, fmt)
    except KilnError:
        raise
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's or TensorRT's own load errors: still one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise KilnError(f"cannot load {config.artifact} (variant {config.variant or 'default'}): "
                        f"{type(exc).__name__}: {first}") from None


def _claim_output(output: _Sink, config: BatchConfig, fmt: str, progress_stream: TextIO) -> set[Any]:
    """Lock OUTPUT for this run (two runs appending the same ids would write them twice), then the
    ids it already holds (trimming a torn last line), or empty it for --no-resume."""
    try:
        fcntl.flock(output.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise KilnError(f"another kiln batch is writing {config.output}; wait for it, or stop it first") from None
    if not config.resume:
        output.file.truncate(0)
        return set()
    done, trimmed = answered_ids(config.output, fmt)
    if trimmed:
        progress_stream.write(f"kiln batch: trimmed a torn last line ({trimmed} bytes) from {config.output}\n")
    return done


def _record(sink: _Sink, summary: Summary, answer: Answer, scan: Scan) -> None:
    if answer.ok:
        summary.done += 1
        summary.completion_tokens += answer.completion_tokens
        sink.write(answer.record)
        return
    summary.failed += 1
    line = answer.line if answer.line is not None else scan.lines.get(answer.id)
    sink.write({**answer.record, "line": line})


def _local_answers(answerer: Answerer, config: BatchConfig, scan: Scan, done: set[Any]) -> Iterator[Answer]:
    # Rows already answered, and rows with no usable id (the scan reported those): by line number,
    # so that a row is not parsed once more only to be skipped.
    skip = {scan.lines[key] for key in done if key in scan.lines} | {line for line, _ in scan.unreadable}
    yield from answerer.answer((number, raw) for number, raw in _numbered_lines(config.input) if number not in skip)


# -- Ray ------------------------------------------------------------------------------------------

class RayWorker:
    """One Ray actor: a runtime and its engine, answering the batches of lines Ray Data hands it."""

    def __init__(self, config: BatchConfig, fmt: str, done: set[Any]) -> None:
        self.answerer = Answerer.load(config, fmt)
        self.done, self.format = done, fmt

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        rows = []
        for raw in batch["text"]:
            try:
                key = row_id(parse_line(raw), self.format)
            except RowError:
                continue  # reported by the driver's scan, with its line number
            if key not in self.done:
                rows.append((None, raw))
        answers = [json.dumps({"id": a.id, "ok": a.ok, "record": a.record, "tokens": a.completion_tokens},
                              ensure_ascii=False) for a in self.answerer.answer(rows)]
        return {"answer": answers}


def _import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401 - the [data] extra
    except ImportError:
        raise KilnError("--ray needs Ray Data: pip install 'kiln[ray]'") from None
    return ray


def _ray_answers(config: BatchConfig, scan: Scan, done: set[Any], gpus: int = 0) -> Iterator[Answer]:
    """The rows answered by `config.workers` Ray actors; each takes a GPU of its own where the variant runs
    on one (`gpus`): Ray hides every GPU from an actor that asks for none, and shows the one it assigns
    as device 0."""
    ray = _import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        address = config.ray_address or os.environ.get("RAY_ADDRESS")
        # A local instance listens on loopback only; a cluster is reached at its address.
        kwargs = {"address": address} if address else {"num_cpus": os.cpu_count(), "include_dashboard": False,
                                                       "_node_ip_address": "127.0.0.1"}
        ray.init(log_to_driver=False, logging_level="warning", **kwargs)
    try:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        workers = config.workers
        threads = max(1, (config.threads or os.cpu_count() or 1) // workers)
        # Ray's CPU count is bookkeeping (ORT's threads do the work), but a reservation that takes
        # every CPU starves Ray Data's read tasks and the job hangs: leave one CPU to them.
        cpus = min(float(threads), max(0.1, (ray.cluster_resources().get("CPU", 1) - 1) / workers))
        worker_config = replace(config, artifact=config.artifact.resolve(), threads=threads,
                                device="cuda:0" if gpus else config.device)
        dataset = ray.data.read_text(str(config.input.resolve()), drop_empty_lines=True, num_cpus=0.25)
        # Batches small enough that every worker gets several (one batch of the whole file would
        # keep all but one worker idle), and no bigger than a chunk.
        todo = sum(1 for key in scan.lines if key not in done)
        batch_rows = max(1, min(config.chunk_rows, -(-todo // (workers * 4))))
        answered = dataset.map_batches(
            RayWorker, batch_size=batch_rows, compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=cpus,
            num_gpus=gpus, fn_constructor_kwargs={"config": worker_config, "fmt": scan.format, "done": done})
        seen = set()
        for row in answered.iter_rows():
            item = json.loads(row["answer"])
            seen.add(item["id"])
            yield Answer(item["id"], scan.lines.get(item["id"]), item["ok"], item["record"], item["tokens"])
        # Ray Data splits lines itself: a row it did not hand to any worker is a failure, never a silent gap.
        for key, line in scan.lines.items():
            if key not in done and key not in seen:
                yield failed_answer(scan.format, line, key, RowError(
                    "no Ray worker answered this row (Ray Data read the line differently); run without --ray",
                    "not_answered", status=None))
    finally:
        if started_here:
            ray.shutdown()
