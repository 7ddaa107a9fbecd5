"""A/B comparison of two models on the same prompts and text: artifact variants or eager checkpoints.

    A (reference) ─┐                                   ┌─> report.json  (machines, CI)
                   ├─> accuracy.reference_run / measure ┼─> report.md    (people, PR comments)
    B (candidate) ─┘                                   └─> report.html  (people, plots and worst prompts)

Both sides go through the runtime's backend interface (compiler/eager.py gives eager torch the
same one), so a side is only "what computes the logits". A is the reference: B is teacher-forced
over A's greedy continuation and KL is taken as KL(A || B). compile-model's validate stage calls
the same functions with eager torch as A and each variant as B.
"""

from __future__ import annotations

import datetime
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from runtime.artifact import Artifact
from runtime.backends.registry import device_of, device_refusal, runnable_variant
from runtime.backends.registry import runs_on as backend_runs_on
from runtime.device import providers_for
from runtime.errors import IncompatibleArtifact
from runtime.files import read_utf8
from runtime.manifest import Variant
from runtime.model import Selection

from .accuracy import (
    GATES,
    Inputs,
    candidate_run,
    compare_runs,
    failed_gates,
    reference_run,
    side_by_side_seconds,
    text_rows,
)
from .errors import CompareInputError
from .recipe import DEFAULT_PROMPTS, DEFAULT_TEXT, Gates, read_prompts

EAGER_PREFIX = "eager:"
REPORT_VERSION = 1


@dataclass
class Side:
    label: str  # as the user wrote it
    description: str
    backend: Any
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab: dict[str, int]
    pad_id: int
    max_context: int
    gates: dict[str, float] = field(default_factory=dict)  # the gates it was compiled with, if any


# -- opening a side -------------------------------------------------------------------------------

def open_side(text: str, eager_device: str = "auto", eager_dtype: str = "fp32", threads: int | None = None,
              verify: bool = True, device: str | None = None) -> Side:
    """`eager:SOURCE` (any model.source a recipe accepts) or `ARTIFACT_DIR[:VARIANT]`, the artifact run on
    `device` (runtime/device.py)."""
    if text.startswith(EAGER_PREFIX):
        return _eager_side(text, eager_device, eager_dtype)
    return _artifact_side(text, threads, verify, device)


def _eager_side(text: str, device: str, dtype: str) -> Side:
    from .load import load_checkpoint
    from .recipe import ModelSpec

    source = text[len(EAGER_PREFIX):]
    if not source:
        raise CompareInputError(f"{text!r}: name a checkpoint after 'eager:', e.g. eager:path/to/hf-folder")
    checkpoint = load_checkpoint(ModelSpec(source=source))
    return eager_side(checkpoint, text, device, dtype)


def eager_side(checkpoint: Any, label: str, device: str = "auto", dtype: str = "fp32") -> Side:
    from .eager import EagerBackend

    try:
        backend = EagerBackend(checkpoint.model, device, dtype)
    except ValueError as exc:
        raise CompareInputError(str(exc)) from None
    tokenizer = checkpoint.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    widened = f", {backend.stored_dtype} weights widened per call" if backend.widened else ""
    details = f"transformers eager ({backend.device.type}, {dtype}{widened}), {checkpoint.source.spec}"
    return Side(label, details, backend,
                lambda s: tokenizer(s, add_special_tokens=True)["input_ids"],
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                tokenizer.get_vocab(), pad, checkpoint.config.max_position_embeddings)


def _artifact_side(text: str, threads: int | None, verify: bool, device: str | None = None) -> Side:
    folder, name = _split_variant(text)
    artifact = Artifact.open(folder, verify=verify)
    providers = providers_for(device)
    entry = _variant_entry(artifact, name, providers)  # any variant with a graph, a failed one too
    refused = device_refusal(entry, device_of(providers))
    if refused:
        raise IncompatibleArtifact(refused)
    loaded = Selection(artifact, entry, verify, providers).open(threads)
    backend, tokenizer = loaded.backend, loaded.tokenizer
    model = artifact.manifest.model
    details = ", ".join(str(p) for p in (entry.target, entry.precision, (entry.quantize or {}).get("mode"),
                                         entry.status) if p)
    runs_on = backend_runs_on(entry)
    return Side(text, f"{artifact.folder.name}:{entry.name} ({details}), {runs_on}", backend,
                tokenizer.encode, tokenizer.decode, tokenizer.vocab, min(model.eos_token_ids, default=0),
                model.max_context, entry.document.get("gates", {}))


def _split_variant(text: str) -> tuple[Path, str | None]:
    if Path(text).is_dir() or ":" not in text:
        return Path(text), None
    folder, name = text.rsplit(":", 1)
    return Path(folder), name or None


def _variant_entry(artifact: Artifact, name: str | None, providers: list[Any] | None = None) -> Variant:
    """Any variant whose graph is in the artifact, when named: a failed one (--keep-failed), or a
    tensorrt one whose engine was skipped, whose graph runs here under ONNX Runtime."""
    variants = artifact.manifest.variants
    if name is not None and name in variants and (variants[name].model or "").endswith(".onnx"):
        return variants[name]
    if name is not None and name in variants:
        raise IncompatibleArtifact(f"{artifact.folder}: variant {name!r} has no ONNX graph to run here")
    if name is not None:
        raise IncompatibleArtifact(f"{artifact.folder}: no variant {name!r}; variants: {', '.join(variants)}")
    return runnable_variant(artifact, providers=providers)


# -- inputs and gates -----------------------------------------------------------------------------

def read_input_files(prompts_file: Path | None, text_file: Path | None) -> tuple[list[str], str]:
    """The prompts and the held-out text, checked before any model is opened."""
    prompts_file, text_file = prompts_file or DEFAULT_PROMPTS, text_file or DEFAULT_TEXT
    for kind, file in (("prompts", prompts_file), ("text", text_file)):
        if not file.is_file():
            raise CompareInputError(f"{kind} file {file}: no such file")
    prompts = read_prompts(prompts_file)
    if not prompts:
        raise CompareInputError(f'prompts file {prompts_file}: no prompts; write one {{"prompt": "..."}} per line')
    return prompts, read_utf8(text_file, f"text file {text_file}", "text", CompareInputError)


def read_inputs(side: Side, prompts_file: Path | None, text_file: Path | None, max_new_tokens: int,
                max_context: int) -> tuple[Inputs, list[str]]:
    prompts, raw_text = read_input_files(prompts_file, text_file)
    text = side.encode(raw_text)
    if len(text) < 2:
        raise CompareInputError(f"text file {text_file}: needs at least 2 tokens of text to score perplexity")
    limit = max_context - max_new_tokens
    if limit < 1:
        raise CompareInputError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in a "
                                f"context of {max_context}")
    encoded = [side.encode(p)[-limit:] for p in prompts]
    return Inputs(text_rows(text, max_context), encoded, max_new_tokens, side.pad_id), prompts


def check_same_tokenizer(a: Side, b: Side, texts: list[str]) -> None:
    """Refuse a comparison whose token ids mean different things on the two sides."""
    if a.vocab != b.vocab:
        differing = next((t for t in sorted(a.vocab) if b.vocab.get(t) != a.vocab[t]), None)
        detail = (f"token {differing!r} is {a.vocab[differing]} in A and {b.vocab.get(differing)} in B"
                  if differing is not None else f"B has {len(set(b.vocab) - set(a.vocab))} tokens A lacks")
        raise CompareInputError(
            f"A and B have different tokenizers ({len(a.vocab)} and {len(b.vocab)} tokens; {detail}); "
            "compare two builds of the same model"
        )
    for text in texts:
        if a.encode(text) != b.encode(text):
            raise CompareInputError(
                f"A and B share a vocabulary but tokenize {text[:40]!r} differently (special tokens or "
                "normalization differ); compare two builds of the same model"
            )
    if a.backend.vocab_size != b.backend.vocab_size:
        raise CompareInputError(f"A's logits have {a.backend.vocab_size} entries and B's {b.backend.vocab_size}")


def read_gates(gates_file: Path | None, overrides: tuple[str, ...], default: dict[str, float]) -> dict[str, float]:
    """--gates FILE (a mapping, or one under a `gates:` key as in a recipe), then each --gate key=value."""
    gates: dict[str, Any] = {}
    if gates_file is not None:
        try:
            loaded = yaml.safe_load(read_utf8(gates_file, f"--gates {gates_file}", "YAML or JSON", CompareInputError))
        except yaml.YAMLError as exc:
            raise CompareInputError(f"--gates {gates_file}: not YAML or JSON ({exc})") from None
        loaded = loaded.get("gates", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(loaded, dict):
            raise CompareInputError(f"--gates {gates_file}: must be a mapping of gate: threshold")
        gates.update(loaded)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise CompareInputError(f"--gate {item}: write it as name=value, e.g. top1_agreement=0.98")
        gates[key.strip()] = value.strip()
    if gates_file is None and not overrides:
        return dict(default)
    try:
        return Gates(**gates).model_dump(exclude_none=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise CompareInputError(f"gate {key!r} is unknown; gates: {', '.join(GATES)}") from None
        raise CompareInputError(f"gate {key}: {err['msg']} (got {err.get('input')!r})") from None


# -- the comparison -------------------------------------------------------------------------------

def compare(a: Side, b: Side, inputs: Inputs, prompts: list[str], gates: dict[str, float],
            speed_repeats: int = 3) -> dict[str, Any]:
    """The whole report as a dict. Tokens/s are the medians of `speed_repeats` interleaved greedy runs
    of each side (0: one timed run each, the ones that produced the continuations)."""
    with tempfile.TemporaryDirectory(prefix="kiln-compare-") as logits:  # both sides' logits, read a row at a time
        reference = reference_run(a.backend, inputs, into=Path(logits) / "a")
        candidate = candidate_run(b.backend, inputs, reference, into=Path(logits) / "b")
        if speed_repeats:
            reference.greedy_seconds, candidate.greedy_seconds = side_by_side_seconds(
                [a.backend, b.backend], inputs, speed_repeats)
        report = assemble(a, b, inputs, prompts, gates, compare_runs(reference, candidate, inputs))
    report["inputs"]["speed_repeats"] = speed_repeats or 1
    return report


def assemble(a: Side, b: Side, inputs: Inputs, prompts: list[str], gates: dict[str, float],
             result: dict[str, Any]) -> dict[str, Any]:
    failures = failed_gates(result["summary"], gates)
    for record in result["prompts"]:
        record["prompt"] = prompts[record["index"]]
        _continuation_texts(record, a.decode)
    return {
        "kiln_report": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "a": {"label": a.label, "description": a.description},
        "b": {"label": b.label, "description": b.description},
        "inputs": {"prompts": len(inputs.prompts), "new_tokens": inputs.new_tokens,
                   "text_tokens": sum(len(r) for r in inputs.text_rows), "speed_repeats": 1},
        "gates": gates,
        "failed_gates": failures,
        "passed": not failures,
        **result,
    }


def _continuation_texts(record: dict[str, Any], decode: Callable[[list[int]], str]) -> None:
    """Both continuations as text, and the part they share, so a report can mark where they part."""
    ref, out = record["reference_tokens"], record["candidate_tokens"]
    first = record["first_divergence"]
    record["reference_text"], record["candidate_text"] = decode(ref), decode(out)
    record["common_text"] = record["reference_text"] if first is None else decode(ref[:first])


def worst_prompts(report: dict[str, Any], count: int = 5) -> list[dict[str, Any]]:
    """Diverged prompts first (earliest divergence first), then by KL."""
    def badness(p: dict[str, Any]) -> tuple:
        diverged = p["first_divergence"] is not None
        return (not diverged, p["first_divergence"] if diverged else 0, -p["kl_divergence"])
    return sorted(report["prompts"], key=badness)[:count]
