"""kiln: one command for everything.

    kiln compile RECIPE ...        = compile-model (needs the compiler extra)
    kiln compare A B ...           = compare-model (needs the compiler extra)
    kiln run ARTIFACT ...          = run-model
    kiln serve ARTIFACT [--port N] ...  the OpenAI API (completions, chat) with continuous batching
    kiln batch ARTIFACT INPUT.jsonl OUTPUT.jsonl ...  bulk inference, resumable; --ray for a cluster
    kiln plan ARTIFACT [--variant V] [--memory 16GiB | --device cuda:0] [--context N] [--batch N]
    kiln plan --config config.json [--dtype fp16] ...   will it fit, and how many at once?
    kiln inspect ARTIFACT[:VARIANT] [--polygraphy-shapes batch=1,seq=8,past=0] [--trtexec-shapes ...] [--json]
    kiln export-for optimum|genai ARTIFACT[:VARIANT] DIR   a folder the tool opens as it is
    kiln pack ARTIFACT -o NAME.kiln [--sign-key KEY]
    kiln verify NAME.kiln|DIR [--public-key KEY] [--require-signature] [--variant V]
    kiln install NAME.kiln --into DIR [--public-key KEY] [--require-signature] [--variant V]
    kiln rollback --into DIR
    kiln keygen NAME

Exit codes: 0 done / verified; 1 refused (tampered, unsigned when a signature is required, does not
fit this host, a corrupted or unsafe archive); 2 bad usage (missing file, unknown option).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .command import OneLineGroup, output_format_options
from .device import DEVICE_HELP, Device
from .device import checked as device_checked
from .errors import KilnError, interrupted_exit_code, unwind_on_sigterm

if TYPE_CHECKING:
    from .artifact import Artifact
    from .manifest import Variant

EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
EXISTING = click.Path(exists=True, path_type=Path)


def _fail(command: str, exc: Exception) -> None:
    if isinstance(exc, KilnError):
        click.echo(f"kiln {command}: error: {exc}", err=True)
    else:  # a bug of ours, or something the checks did not foresee: still one line, still refused
        click.echo(f"kiln {command}: internal error: {type(exc).__name__}: {exc}", err=True)
    sys.exit(1)


@click.group("kiln", cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def kiln() -> None:
    """Compile, compare, run and ship Kiln artifacts."""


def _forward(name: str, module: str, attribute: str, help_text: str) -> None:
    @kiln.command(name, help=help_text, add_help_option=False,
                  context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        import importlib

        try:
            target = getattr(importlib.import_module(module), attribute)
        except ImportError as exc:
            click.echo(f"kiln {name}: needs the compiler extra (pip install 'kiln[compiler,cpu]'): {exc}", err=True)
            sys.exit(2)
        target.main(args=list(args), prog_name=f"kiln {name}")


_forward("compile", "compiler.cli", "main", "Compile a recipe (compile-model).")
_forward("compare", "compiler.cli", "compare_main", "Compare two models (compare-model).")
_forward("run", "runtime.cli", "main", "Generate with an artifact (run-model).")


@kiln.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--variant", help="Variant to serve [default: the first built one this host runs].")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="KILN_HOST",
              help="Address to listen on (0.0.0.0 for every interface), or set KILN_HOST (the images set "
                   "0.0.0.0).")
@click.option("--port", default=8000, show_default=True, envvar="KILN_PORT",
              help="Port to listen on (0: any free port, printed), or set KILN_PORT.")
@click.option("--max-batch-size", default=32, show_default=True, type=click.IntRange(min=1),
              help="Most sequences decoded together; more requests wait in the queue.")
@click.option("--max-queue", default=256, show_default=True, type=click.IntRange(min=0),
              help="Most requests waiting for a row; past it a request gets 429 with Retry-After.")
@click.option("--max-prefill-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Most prompt tokens run between two decode steps (longer prompts go in pieces where the "
                   "variant allows): bounds how long a burst of prompts stalls the running requests.")
@click.option("--device", help=DEVICE_HELP, callback=device_checked)
@click.option("--threads", type=click.IntRange(min=1), envvar="KILN_THREADS",
              help="ONNX Runtime intra-op threads, or set KILN_THREADS [default: all cores].")
@click.option("--max-tokens-in-flight", type=click.IntRange(min=1),
              help="KV slots the running requests may reserve (prompt + max_tokens each); more wait in the queue "
                   "[default: what this host's free memory holds, from the memory plan (kiln plan)].")
@click.option("--prefix-cache-mib", type=click.FloatRange(min=0),
              help="Memory for the KV of prompt prefixes, reused by prompts that begin alike; 0 turns it off "
                   "[default: a quarter of the batch at the max context, at most 1/8 of free memory].")
@click.option("--api-key", envvar="KILN_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 routes (or set KILN_API_KEY).")
@click.option("--model-name", help="The model id clients send [default: the artifact's name].")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM or Ctrl-C, seconds to let running requests finish before aborting them.")
@click.option("--stream-buffer", default=256, show_default=True, type=click.IntRange(min=1),
              help="Tokens per sequence a stream may have waiting behind a write stuck on its client; past "
                   "it the request is aborted, so a client that does not read holds its rows no longer.")
@click.option("--write-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds a write may wait for a stream's client to make room before its connection is "
                   "aborted (what was buffered for it dropped).")
@click.option("--send-buffer", default=256 * 1024, show_default=True, type=click.IntRange(min=0),
              help="Kernel send buffer per connection in bytes (0: the OS default, which grows to megabytes "
                   "a silent client may leave unread).")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the artifact (trusted hosts only).")
def serve(artifact: Path, variant: str | None, host: str, port: int, max_batch_size: int, max_queue: int,
          max_prefill_tokens: int, device: str | None, threads: int | None, max_tokens_in_flight: int | None,
          api_key: str | None, model_name: str | None, drain_timeout: float, stream_buffer: int,
          write_timeout: float, send_buffer: int, prefix_cache_mib: float | None, no_verify: bool) -> None:
    """Serve ARTIFACT over the OpenAI API: POST /v1/completions and /v1/chat/completions (streaming or
    not), GET /v1/models, /health and /metrics (Prometheus). Concurrent requests share the model:
    a request that arrives while others decode joins the running batch at the next step.

    Exit codes: 0 after a drain (SIGTERM, Ctrl-C); 1 when the model fails to load; 2 for a missing or
    modified artifact, an unknown variant or a port that cannot be bound."""
    try:
        from .server import ServeConfig
        from .server import serve as run_server
    except ImportError as exc:
        click.echo(f"kiln serve: error: a server dependency is missing ({exc.name}); reinstall kiln", err=True)
        sys.exit(2)
    config = ServeConfig(artifact, variant, host, port, max_batch_size, max_queue, max_prefill_tokens, threads,
                         api_key, model_name, drain_timeout, not no_verify, max_tokens_in_flight, device,
                         stream_buffer, write_timeout, send_buffer or None, prefix_cache_mib)
    try:
        code = run_server(config)
    except KilnError as exc:
        click.echo(f"kiln serve: error: {exc}", err=True)
        sys.exit(2)
    sys.exit(code)


@kiln.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("input_file", metavar="INPUT", type=EXISTING_FILE)
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--variant", help="Variant to run [default: the first built one this host runs].")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path),
              help="Where failed rows go, with their line and reason [default: OUTPUT.errors.jsonl].")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Skip the ids OUTPUT already holds (a rerun after a kill), or start OUTPUT over.")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1),
              help="Most sequences decoded together.")
@click.option("--device", help=DEVICE_HELP, callback=device_checked)
@click.option("--threads", type=click.IntRange(min=1),
              help="ONNX Runtime threads [default: all cores]; with --ray, split between the workers.")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Default max_tokens for rows that give none "
              "[default: up to the context, as kiln serve].")
@click.option("--temperature", type=click.FloatRange(min=0), help="Default temperature (0: greedy) "
              "[default: the artifact's generation config, else 1].")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="Default top_p.")
@click.option("--top-k", type=click.IntRange(min=0), help="Default top_k (0: off).")
@click.option("--seed", type=int, help="Default seed, for sampled rows that reproduce.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Run on Ray Data: a local instance, RAY_ADDRESS, or ADDRESS (ray://HOST:10001). "
                   "Put it last, or write --ray=ADDRESS.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --ray: runtimes (Ray actors) answering rows at once.")
@click.option("--chunk-rows", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Rows read, sorted by length and synced to disk at a time (bounds memory and lost work).")
@click.option("--model-name", help="The model name in OpenAI response bodies [default: the artifact's name].")
@click.option("--prefix-cache-mib", type=click.FloatRange(min=0),
              help="Memory for the KV of prompt prefixes (each worker's own), reused by rows that begin alike; "
                   "0 turns it off [default: a quarter of the batch at the max context, at most 1/8 of free "
                   "memory].")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the artifact (trusted hosts only).")
@output_format_options
def batch(artifact: Path, input_file: Path, output: Path, variant: str | None, errors: Path | None, resume: bool,
          batch_size: int, device: str | None, threads: int | None, max_tokens: int | None, temperature: float | None,
          top_p: float | None, top_k: int | None, seed: int | None, ray_address: str | None, workers: int,
          chunk_rows: int, model_name: str | None, no_verify: bool, json_schema: str | None, regex: str | None,
          choice: str | None, grammar: str | None, prefix_cache_mib: float | None) -> None:
    """Answer every row of INPUT (JSONL) into OUTPUT (JSONL); rerun the same command to resume.

    Rows are OpenAI Batch API lines ({"custom_id", "method", "url", "body"}) or simple ones ({"id",
    "prompt" or "messages", sampling fields}); a row's own fields beat the defaults given here.
    Output lines come in the order rows finish, keyed by their id.

    Exit codes: 0 every row answered; 1 some rows failed (see ERRORS); 2 a bad command line, input
    (duplicate ids) or artifact; 130 interrupted by Ctrl-C, 143 by SIGTERM (rerun to resume)."""
    from .batch import BatchConfig, run_job

    defaults = {key: value for key, value in (("max_tokens", max_tokens), ("temperature", temperature),
                                              ("top_p", top_p), ("top_k", top_k), ("seed", seed))
                if value is not None}
    from .structured import format_of_options

    try:  # the output format of rows that ask for none
        output_format = format_of_options(json_schema, regex, choice, grammar)
    except ValueError as exc:
        click.echo(f"kiln batch: error: {exc}", err=True)
        sys.exit(2)
    defaults.update(output_format.api_fields() if output_format else {})
    config = BatchConfig(artifact, input_file, output, variant, errors, batch_size, threads=threads,
                         chunk_rows=chunk_rows, resume=resume, defaults=defaults, ray=ray_address is not None,
                         ray_address=ray_address or None, workers=workers, verify=not no_verify,
                         model_name=model_name, device=device, prefix_cache_mib=prefix_cache_mib)
    unwind_on_sigterm()  # as Ctrl-C: what finished is synced first
    try:
        summary = run_job(config)
    except KilnError as exc:
        click.echo(f"kiln batch: error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        click.echo(f"kiln batch: interrupted; what finished is in {output}: rerun the same command to resume",
                   err=True)
        sys.exit(interrupted_exit_code(exc))
    except Exception as exc:  # a worker that died, a bug of ours: one line; what finished is kept
        first = (str(exc).strip().splitlines() or [""])[0]
        click.echo(f"kiln batch: internal error: {type(exc).__name__}: {first}; what finished is in {output}: "
                   "rerun the same command to resume", err=True)
        sys.exit(1)
    rate = (summary.done + summary.failed) / max(summary.seconds, 1e-9)
    click.echo(f"kiln batch: {summary.done:,} done, {summary.failed:,} failed, {summary.skipped:,} skipped "
               f"(already in {output.name}) in {summary.seconds:.1f} s ({rate:.1f} rows/s, "
               f"{summary.completion_tokens / max(summary.seconds, 1e-9):,.0f} output tok/s)"
               + (f"; failed rows are in {config.errors_path}" if summary.failed else ""), err=True)
    sys.exit(summary.exit_code)


@kiln.command()
@click.argument("artifact", required=False, type=click.Path(path_type=Path))
@click.option("--variant", help="Variant to plan [default: the first built one this host runs].")
@click.option("--config", "config_file", type=EXISTING_FILE,
              help="Plan from a transformers config.json alone, no artifact: weights and KV cache from its shapes.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="With --config: the weights' and KV cache's precision.")
@click.option("--memory", "memory_text", metavar="SIZE", help="Budget, e.g. 16GiB [default: what this host has free].")
@click.option("--device", callback=device_checked,
              help="cuda or cuda:N: the budget is that GPU's free memory (read with cuda-python, no torch); cpu: "
                   "this host's; auto: where the variant runs [default: auto].")
@click.option("--context", type=click.IntRange(min=1), help="Tokens a sequence holds [default: the max context].")
@click.option("--batch", default=32, show_default=True, type=click.IntRange(min=1), help="Sequences at once.")
@click.option("--prefill-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens a step runs at most (kiln serve's --max-prefill-tokens).")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON.")
def plan(artifact: Path | None, variant: str | None, config_file: Path | None, dtype: str, memory_text: str | None,
         device: str | None, context: int | None, batch: int, prefill_tokens: int, as_json: bool) -> None:
    """Will it fit? Before loading anything: the weights, the KV cache a token and a sequence, the
    activations, the peak at BATCH x CONTEXT, and the largest batch (and context) the memory holds.

    Exit codes: 0 fits; 1 does not fit; 2 bad input."""
    import json

    from . import memory as planner

    try:
        if (artifact is None) == (config_file is None):
            raise KilnError("give an ARTIFACT folder or --config config.json (one of them)")
        on_device = Device.parse(device)
        if memory_text and on_device.kind == "cuda":
            raise KilnError("give --memory or --device, not both")
        title, interface, measured, weights, max_context, on_gpu = _plan_source(artifact, variant, config_file,
                                                                                dtype, device)
        weights_source = "computed from the config's shapes" if config_file else "not measured: the files' size"
        if memory_text:
            budget, source = planner.parse_size(memory_text), "--memory"
        elif on_gpu or on_device.kind == "cuda":
            gpu = str(on_device) if on_device.kind == "cuda" else "cuda:0"
            budget, source = planner.free_gpu_memory(gpu), f"free on {gpu}"
        else:
            budget, source = planner.free_host_memory(), "free on this host (MemAvailable)"
        facts = planner.report(interface, measured, weights, batch, context or max_context, max_context,
                               prefill_tokens, budget, source, weights_source,
                               prefix_cache_bytes=0 if on_gpu or on_device.kind == "cuda" else None)
    except (KilnError, ValueError) as exc:
        click.echo(f"kiln plan: error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(facts, indent=2) if as_json else planner.render(facts, title))
    sys.exit(0 if facts["fits"] else 1)


def _plan_source(artifact: Path | None, variant: str | None, config_file: Path | None, dtype: str,
                 device: str | None = None) -> tuple:
    """(title, interface, measured memory or None, weights bytes, max context, whether its memory is a GPU's
    (an engine's)) of an artifact's
    variant or of a bare config.json; the interface of the graph this host runs it with (on `device`, a
    GPU: the variant's own, whose KV cache may be wider than the CPU kernels' graph's)."""
    import json

    from .files import read_utf8
    from .memory import config_interface, variant_file_bytes

    if config_file is not None:
        try:
            config = json.loads(read_utf8(config_file, f"--config {config_file}", "JSON"))
        except ValueError as exc:
            raise KilnError(f"--config {config_file}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise KilnError(f"--config {config_file}: not a JSON object")
        interface, weights = config_interface(config, dtype)
        max_context = int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)
        return (f"kiln plan: {config_file} ({dtype}, from its shapes alone)", interface, None, weights, max_context,
                None)
    from .backends.registry import memory_on_host, served_interface
    from .model import select_variant

    # the plan reads the manifest only; a plan of a graph this host (or, with --device, a GPU) never runs
    # is refused
    providers = Device.parse(device).providers
    selection = select_variant(artifact, variant, providers, verify=False)
    opened, entry = selection.artifact, selection.entry
    weights = variant_file_bytes(opened.manifest, entry)
    kind = ", ".join(str(k) for k in (entry.target, entry.precision, (entry.quantize or {}).get("mode")) if k)
    title = f"kiln plan: {opened.manifest.name}:{entry.name} ({kind})"

    return (title, served_interface(entry, providers), entry.memory, weights, opened.manifest.model.max_context,
            not memory_on_host(entry, providers))


def _artifact_variant(spec: str) -> tuple[Path, str | None]:
    """ARTIFACT[:VARIANT]; a folder that exists under the whole name is that folder (colons and all)."""
    path = Path(spec)
    if path.exists() or ":" not in spec:
        return path, None
    folder, _, variant = spec.rpartition(":")
    return Path(folder), variant or None


@kiln.command()
@click.argument("spec", metavar="ARTIFACT[:VARIANT]")
@click.option("--polygraphy-shapes", "polygraphy_sizes", metavar="SIZES",
              help="Print polygraphy run's --input-shapes for SIZES, e.g. batch=1,seq=8,past=0 (capacity=N for "
                   "a shared-buffer graph's KV buffers: past + seq unless given).")
@click.option("--trtexec-shapes", "trtexec_sizes", metavar="SIZES", help="Print trtexec's --shapes for SIZES.")
@click.option("--json", "as_json", is_flag=True, help="Print the variant's manifest entry as JSON.")
def inspect(spec: str, polygraphy_sizes: str | None, trtexec_sizes: str | None, as_json: bool) -> None:
    """What a variant is: its graph, interface, fusions, accuracy, and the tools that open its folder;
    or the input shapes NVIDIA's tools need, for one copy-paste."""
    import json

    from . import interop
    from .artifact import Artifact

    folder, name = _artifact_variant(spec)
    try:
        artifact = Artifact.open(folder, verify=False)  # the manifest only
        entry = artifact.variant(name)
        lines = []
        for sizes, render in ((polygraphy_sizes, interop.polygraphy_argument),
                              (trtexec_sizes, interop.trtexec_argument)):
            if sizes is not None:
                lines.append(render(interop.input_shapes(entry.interface, interop.parse_sizes(sizes))))
    except (KilnError, ValueError) as exc:
        click.echo(f"kiln inspect: error: {exc}", err=True)
        sys.exit(2)
    if lines:
        click.echo("\n".join(lines))
    elif as_json:
        click.echo(json.dumps({"name": entry.name, **entry.document}, indent=2))
    else:
        click.echo(_describe_variant(artifact, entry))


def _describe_variant(artifact: Artifact, entry: Variant) -> str:
    from .backends.base import expand
    from .backends.registry import opens_in_other_tools

    interface, name, record = entry.interface, entry.name, entry.document  # record: the build's, as written
    quantize = (entry.quantize or {}).get("mode")
    kind = ", ".join(str(k) for k in (entry.target, entry.precision, quantize,
                                         "fused" if record.get("fuse") else "unfused") if k)
    graph = artifact.folder / entry.model
    accuracy = record.get("accuracy") or {}
    lines = [f"{artifact.manifest.name}:{name} ({kind}), {entry.status}",
             f"  graph      {graph} ({record.get('node_count', '?')} nodes)"]
    if accuracy:
        lines.append(f"  accuracy   top-1 {accuracy['top1_agreement']:.3f}, perplexity "
                     f"{accuracy['perplexity_change']:+.2%}, greedy match {accuracy['greedy_match']:.2f} vs eager"
                     + (f"; missed its gates ({', '.join(entry.model_failed_gates)}): not run, the variant is "
                        "for Kiln's CPU kernels alone" if entry.model_failed_gates else ""))
    if entry.kernel_model is not None:
        from .cpu_kernels import bf16, library

        kernels, why = library()
        measured = record["kernel_accuracy"]
        lines.append(f"  kernels    {artifact.folder / entry.kernel_model}: top-1 {measured['top1_agreement']:.3f}, "
                     f"perplexity {measured['perplexity_change']:+.2%} vs eager; "
                     + ("this host runs it" if kernels else
                        f"this host cannot run the variant ({why}): it is for these kernels alone"
                        if entry.cpu_kernels == "required" else f"this host runs the graph above ({why})")
                     + ("; prompts of different lengths prefill in one step"
                        if kernels and entry.kernel_prefill == "batched" else "")
                     + (f"; its KV cache {entry.kernel_kv_cache}" if entry.kernel_kv_cache else "")
                     + (f"; 4-bit activations {entry.kernel_activations}" if entry.kernel_activations else "")
                     + ((" on AVX-512 BF16" if bf16() else " on FMAs (the same numbers)")
                        if kernels and entry.kernel_activations else ""))
    fused = ", ".join(f"{k} {v}" for k, v in (record.get("fusions") or {}).items() if v) or "none"
    lines.append(f"  fusions    {fused}")
    lines.append(f"  kv cache   {interface.layers} layers x {interface.kv_heads} heads x {interface.head_dim}"
                 f", {interface.kv_sharing}")
    for label, specs in (("inputs", interface.inputs), ("outputs", interface.outputs)):
        for i, spec in enumerate(specs):
            shown = spec.name.replace("{layer}", f"0..{interface.layers - 1}")
            lines.append(f"  {label if i == 0 else '':<10} {shown} {spec.dtype} [{', '.join(map(str, spec.shape))}]")
    count = len(expand(interface.inputs, interface.layers))
    lines.append(f"  ({count} graph inputs; --polygraphy-shapes batch=1,seq=8,past=0 spells out their shapes)")
    if entry.sidecars:
        from .interop import optimum_problem

        problem = optimum_problem(artifact.manifest.document, name)
        tools = "onnxruntime-genai (og.Model)" if problem else \
            "Optimum (ORTModelForCausalLM.from_pretrained) and onnxruntime-genai (og.Model)"
        lines.append(f"  opens in   {tools} from {graph.parent}")
        if problem:
            lines.append(f"  not in     {problem}")
    elif entry.model_failed_gates:
        lines.append("  opens in   Kiln alone: its model.onnx, which other tools would run, missed its gates")
    elif opens_in_other_tools(entry):
        lines.append("  opens in   kiln export-for optimum|genai writes a folder the tool opens")
    return "\n".join(lines)


@kiln.command("export-for")
@click.argument("tool", type=click.Choice(["optimum", "genai"]))
@click.argument("spec", metavar="ARTIFACT[:VARIANT]")
@click.argument("out", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--copy", is_flag=True, help="Copy the graph files [default: hard links where the file system allows].")
def export_for(tool: str, spec: str, out: Path, copy: bool) -> None:
    """Write DIR, a new folder TOOL opens as it is: the variant's graph and the files TOOL reads
    (config.json or genai_config.json, the tokenizer), written from the manifest. For artifacts whose
    variant folders lack them; newer artifacts' variant folders open directly."""
    from .artifact import Artifact
    from .backends.registry import opens_in_other_tools
    from .interop import export_folder

    folder, name = _artifact_variant(spec)
    try:
        artifact = Artifact.open(folder)  # verified: what is handed on is what was compiled
        if name is None:  # the first built variant whose model.onnx, which the tool runs, passed its gates
            name = next((n for n, e in artifact.manifest.built().items()
                         if not e.model_failed_gates and opens_in_other_tools(e)), None)
        variant = artifact.variant(name).name
        written = export_folder(artifact, variant, tool, out, link=not copy)
    except Exception as exc:
        _fail("export-for", exc)
    click.echo(f"{out}: {', '.join(written)}")


@kiln.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The archive to write, e.g. smollm2.kiln.")
@click.option("--sign-key", type=EXISTING_FILE, help="ed25519 private key (kiln keygen) to sign the manifest.")
def pack(artifact: Path, output: Path, sign_key: Path | None) -> None:
    """Pack an artifact folder into one deterministic .kiln file (tar + gzip)."""
    from .ship import pack as pack_artifact

    try:
        path = pack_artifact(artifact, output, sign_key)
    except Exception as exc:
        _fail("pack", exc)
    click.echo(f"{path} ({path.stat().st_size / 1e6:.1f} MB{', signed' if sign_key else ''})")


@kiln.command()
@click.argument("source", type=EXISTING)
@click.option("--public-key", type=EXISTING_FILE, help="Check the manifest's signature with this ed25519 key.")
@click.option("--require-signature", is_flag=True, help="Refuse an unsigned artifact (needs --public-key).")
@click.option("--variant", help="Exit 1 unless this variant runs on this host [default: any variant].")
def verify(source: Path, public_key: Path | None, require_signature: bool, variant: str | None) -> None:
    """Verify a .kiln file or an artifact folder: integrity, signature, and what runs on this host."""
    from .ship import require_fit
    from .ship import verify as verify_artifact

    try:
        notes, fits = verify_artifact(source, public_key, require_signature)
    except Exception as exc:
        _fail("verify", exc)
    for note in notes:
        click.echo(f"ok  {note}")
    rows = [("variant", "target", "needs", "this host", "runs here")]
    rows += [(f.variant, f.target, f.needs, f.here, "yes" if f.fits else f"no: {f.reason}") for f in fits]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[4])
    try:
        require_fit(fits, variant)
    except Exception as exc:
        _fail("verify", exc)


@kiln.command()
@click.argument("archive", type=EXISTING_FILE)
@click.option("--into", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Install folder: versions/, current -> the new version, previous -> the one before.")
@click.option("--public-key", type=EXISTING_FILE, help="Check the manifest's signature with this ed25519 key.")
@click.option("--require-signature", is_flag=True, help="Refuse an unsigned archive (needs --public-key).")
@click.option("--variant", help="Refuse unless this variant runs on this host [default: any variant].")
def install(archive: Path, into: Path, public_key: Path | None, require_signature: bool,
            variant: str | None) -> None:
    """Unpack into a staging folder, verify, then atomically switch INTO/current to the new version."""
    from .ship import install as install_archive

    try:
        version = install_archive(archive, into, public_key, require_signature, variant)
    except Exception as exc:
        _fail("install", exc)
    click.echo(f"{into / 'current'} -> {version}")


@kiln.command()
@click.option("--into", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
def rollback(into: Path) -> None:
    """Point INTO/current back at the previous version."""
    from .ship import rollback as roll_back

    try:
        version = roll_back(into)
    except Exception as exc:
        _fail("rollback", exc)
    click.echo(f"{into / 'current'} -> {version}")


@kiln.command()
@click.argument("name", type=click.Path(dir_okay=False, path_type=Path))
def keygen(name: Path) -> None:
    """Write NAME.key (private, mode 0600) and NAME.pub: an ed25519 key pair for signing artifacts."""
    from .signing import keygen as make_keys

    try:
        private, public = make_keys(name)
    except Exception as exc:
        _fail("keygen", exc)
    click.echo(f"{private}\n{public}")


if __name__ == "__main__":
    kiln()
