"""compile-model RECIPE [--out DIR] [--variant NAME ...] [--keep-failed] [--strict] [--debug] [--no-memory-check]
                  [--no-disk-check]
compare-model A B [--prompts FILE] [--text FILE] [--max-new-tokens N] [--gates FILE] [--gate K=V ...] [--report DIR]
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from runtime.command import OneLineCommand
from runtime.device import DEVICE_HELP
from runtime.device import checked as device_checked
from runtime.errors import ArtifactError, IncompatibleArtifact, KilnError, interrupted_exit_code, unwind_on_sigterm

from .errors import CheckpointError, CompareInputError, OutputError, RecipeError

# Bad input (exit 2) versus a compile that ran and failed (exit 1, e.g. ExportMismatch).
BAD_INPUT = (RecipeError, CheckpointError, OutputError, CompareInputError)
COMPARE_BAD_INPUT = (*BAD_INPUT, ArtifactError, IncompatibleArtifact)


@click.command("compile-model", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--out", "out", type=click.Path(file_okay=False), help="Artifact folder [default: out/<recipe name>].")
@click.option("--variant", "variants", multiple=True, metavar="NAME", help="Build only this variant (repeatable).")
@click.option("--keep-failed", is_flag=True,
              help="Keep variants that miss their accuracy gates, marked failed in the manifest, and exit 0.")
@click.option("--strict", is_flag=True,
              help="Fail (exit 1) when a tensorrt variant cannot be built here instead of recording it as skipped.")
@click.option("--debug", is_flag=True, help="Show full tracebacks and the exporter's own output.")
@click.option("--no-memory-check", is_flag=True,
              help="Compile even where the predicted peak memory is over what this host has free.")
@click.option("--no-disk-check", is_flag=True,
              help="Compile even where the predicted disk use is over what the output folder's disk has free.")
def main(recipe: str, out: str | None, variants: tuple[str, ...], keep_failed: bool, strict: bool,
         debug: bool, no_memory_check: bool, no_disk_check: bool) -> None:
    """Compile the model a RECIPE names into a validated artifact folder."""
    from .pipeline import compile_recipe  # heavy imports only once the arguments are known good

    # Claim the root logger first: ONNX Runtime's quantization tools call logging.basicConfig(INFO) on
    # import and would print every node they skip. Libraries' warnings are for --debug too.
    logging.basicConfig(level=logging.INFO if debug else logging.ERROR)
    unwind_on_sigterm()  # so the staging folder is removed on the way out
    try:
        folder = compile_recipe(recipe, out, variants, debug=debug, keep_failed=keep_failed, strict=strict,
                                memory_check=not no_memory_check, disk_check=not no_disk_check)
    except KilnError as exc:
        if debug:
            raise
        click.echo(f"compile-model: error: {exc}", err=True)
        sys.exit(2 if isinstance(exc, BAD_INPUT) else 1)
    except KeyboardInterrupt as exc:
        click.echo("compile-model: interrupted; nothing was written", err=True)
        sys.exit(interrupted_exit_code(exc))
    except Exception as exc:  # a bug of ours or a library's: still one line unless --debug
        if debug:
            raise
        click.echo(f"compile-model: internal error: {type(exc).__name__}: {exc} (rerun with --debug)", err=True)
        sys.exit(1)
    click.echo(str(folder))


@click.command("compare-model", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a")
@click.argument("b")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path),
              help='JSONL of {"prompt": ...} [default: compiler/data/prompts.jsonl].')
@click.option("--text", "text_file", type=click.Path(path_type=Path),
              help="Held-out text for perplexity [default: compiler/data/heldout.txt].")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option("--gates", "gates_file", type=click.Path(path_type=Path),
              help="YAML/JSON mapping gate: threshold [default: the gates B was compiled with].")
@click.option("--gate", "gate_items", multiple=True, metavar="NAME=VALUE",
              help="A gate (repeatable; overrides --gates).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write report.json, report.md and report.html here.")
@click.option("--device", help="Where an artifact side runs: " + DEVICE_HELP, callback=device_checked)
@click.option("--eager-device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where an eager side runs.")
@click.option("--eager-dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads [default: all cores].")
@click.option("--speed-repeats", default=3, show_default=True, type=click.IntRange(0),
              help="Interleaved timed greedy runs per side for tokens/s (median); 0 times the measuring run.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of artifacts (trusted hosts only).")
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
def compare_main(a, b, prompts_file, text_file, max_new_tokens, gates_file, gate_items, report_dir, device,
                 eager_device, eager_dtype, threads, speed_repeats, no_verify, debug) -> None:
    """Compare B against A on the same prompts and text. A and B are each ARTIFACT_DIR[:VARIANT] or
    eager:SOURCE (any model.source a recipe accepts). Exit 0 when every gate holds, 1 when one fails,
    2 for bad input."""
    logging.basicConfig(level=logging.INFO if debug else logging.ERROR)
    unwind_on_sigterm()  # so both sides' logits files are removed on the way out
    try:
        report, paths = _compare(a, b, prompts_file, text_file, max_new_tokens, gates_file, gate_items, report_dir,
                                 eager_device, eager_dtype, threads, speed_repeats, not no_verify, device)
    except KilnError as exc:
        if debug:
            raise
        click.echo(f"compare-model: error: {exc}", err=True)
        sys.exit(2 if isinstance(exc, COMPARE_BAD_INPUT) else 1)
    except Exception as exc:
        if debug:
            raise
        click.echo(f"compare-model: internal error: {type(exc).__name__}: {exc} (rerun with --debug)", err=True)
        sys.exit(1)
    _print_summary(report, paths)
    for line in report["failed_gates"]:
        click.echo(f"compare-model: gate failed: {line}", err=True)
    sys.exit(0 if report["passed"] else 1)


def _compare(a, b, prompts_file, text_file, max_new_tokens, gates_file, gate_items, report_dir, eager_device,
             dtype, threads, speed_repeats, verify, device=None):
    from .compare import check_same_tokenizer, compare, open_side, read_gates, read_input_files, read_inputs
    from .progress import StageLog
    from .report import write_report

    given_gates = read_gates(gates_file, gate_items, {}) if gates_file or gate_items else None  # before loading
    read_input_files(prompts_file, text_file)
    log = StageLog()
    with log.stage("open", f"A {a}"):
        side_a = open_side(a, eager_device, dtype, threads, verify, device)
    with log.stage("open", f"B {b}"):
        side_b = open_side(b, eager_device, dtype, threads, verify, device)
    gates = side_b.gates if given_gates is None else given_gates
    context = min(side_a.max_context, side_b.max_context)
    inputs, prompts = read_inputs(side_a, prompts_file, text_file, max_new_tokens, context)
    check_same_tokenizer(side_a, side_b, prompts)
    with log.stage("compare", f"{len(prompts)} prompts x {max_new_tokens} tokens, "
                              f"{sum(len(r) for r in inputs.text_rows)} text tokens"):
        report = compare(side_a, side_b, inputs, prompts, gates, speed_repeats)
    paths = write_report(report, report_dir) if report_dir is not None else []
    return report, paths


def _print_summary(report: dict, paths: list) -> None:
    from .report import fmt

    s = report["summary"]
    click.echo(f"A: {report['a']['description']}\nB: {report['b']['description']}")
    rows = [("perplexity A / B", f"{fmt('perplexity_reference', s['perplexity_reference'])} / "
             f"{fmt('perplexity', s['perplexity'])} ({fmt('perplexity_change', s['perplexity_change'])})"),
            ("top-1 agreement", fmt("top1_agreement", s["top1_agreement"])),
            ("greedy exact match", fmt("greedy_match", s["greedy_match"])),
            ("KL(A || B) mean / max", f"{fmt('kl_divergence', s['kl_divergence'])} / "
             f"{fmt('kl_divergence_max', s['kl_divergence_max'])}"),
            ("max |logit error|", fmt("max_logit_error", s["max_logit_error"])),
            ("prefill cosine (worst)", fmt("prefill_cosine", s["prefill_cosine"])),
            ("tokens/s A / B", f"{fmt('tokens_per_second_reference', s['tokens_per_second_reference'])} / "
             f"{fmt('tokens_per_second', s['tokens_per_second'])} "
             f"({fmt('tokens_per_second_ratio', s['tokens_per_second_ratio'])}x)")]
    for label, value in rows:
        click.echo(f"  {label:<24} {value}")
    verdict = "no gates given" if not report["gates"] else ("PASS" if report["passed"] else "FAIL")
    click.echo(f"gates: {verdict}" + "".join(f"\nreport: {p}" for p in paths))


if __name__ == "__main__":
    main()
