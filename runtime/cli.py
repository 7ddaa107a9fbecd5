"""run-model ARTIFACT [--prompt TEXT ...] [--prompts-file FILE.jsonl] [--chat] [sampling options]

    check every input (prompts file, --output's folder) -> load the artifact -> decode -> print, and
    write each result to --output as it finishes (a failure later keeps what finished)

A bad prompt (a line that is not JSON, an empty prompt, one past the context) fails alone: the
others are answered and the exit code is 1. Bad input to the command itself is exit 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from .command import OneLineCommand, output_format_options
from .device import DEVICE_HELP
from .device import checked as device_checked
from .engine import Result
from .errors import KilnError, interrupted_exit_code, unwind_on_sigterm
from .files import read_utf8


@dataclass(frozen=True)
class BadLine:
    """A --prompts-file line that holds no prompt: reported as that prompt's error."""

    error: str


def _read_prompts(texts: tuple[str, ...], prompts_file: str | None, chat: bool) -> list:
    prompts: list = list(texts)
    if prompts_file:
        text = read_utf8(Path(prompts_file), f"--prompts-file {prompts_file}", "JSON lines")
        prompts += [_prompt_of(line, number, prompts_file) for number, line in enumerate(text.splitlines(), 1)
                    if line.strip()]
    if chat:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise KilnError("give at least one --prompt or a --prompts-file")
    if all(isinstance(p, BadLine) for p in prompts):
        raise KilnError(f"--prompts-file {prompts_file}: no line holds a prompt; the first: {prompts[0].error}")
    return prompts


def _prompt_of(line: str, number: int, prompts_file: str) -> str | list | BadLine:
    where = f"{prompts_file}:{number}"
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than json can parse
        return BadLine(f"not JSON ({where}: {getattr(exc, 'msg', type(exc).__name__)})")
    if isinstance(record, str):
        return record
    prompt = record.get("messages") or record.get("prompt", "") if isinstance(record, dict) else None
    if isinstance(prompt, str | list):
        return prompt
    return BadLine(f'not a prompt ({where}: want a JSON string, {{"prompt": "..."}} or {{"messages": [...]}})')


def _check_output(output: str | None) -> None:
    """Before any model is loaded: results could not be written there."""
    if output is None:
        return
    parent = Path(output).resolve().parent
    if not parent.is_dir():
        raise KilnError(f"--output {output}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (Path(output).exists() and not os.access(output, os.W_OK)):
        raise KilnError(f"--output {output}: not writable")


@click.command("run-model", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path())
@click.option("--variant", help="Variant to run [default: the first built one this host runs].")
@click.option("--prompt", "texts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False),
              help='JSONL: {"prompt": "..."} or {"messages": [...]} per line.')
@click.option("--chat", is_flag=True, help="Wrap plain prompts as a user message in the model's chat template.")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--min-p", default=0.0, show_default=True)
@click.option("--repetition-penalty", default=1.0, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--num-beams", default=1, show_default=True, type=click.IntRange(min=1),
              help="Beam search with this many beams (as transformers' generate(num_beams=...)); 1 decodes greedily "
                   "or samples.")
@click.option("--length-penalty", default=1.0, show_default=True,
              help="Beam scores are sum of log-probs / length ** this: > 0 favours longer answers.")
@click.option("--early-stopping", type=click.Choice(["false", "true", "never"]), default="false", show_default=True,
              help="Beam search ends when no beam can beat the finished ones (false), as soon as num_beams have "
                   "finished (true), or only when no beam could ever (never).")
@click.option("--num-return-sequences", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --num-beams: print the best N beams, each with its score.")
@click.option("--seed", type=int, help="Seed for sampling; each prompt's draws are reproducible.")
@click.option("--batch-size", default=32, show_default=True, help="Largest batch decoded at once.")
@click.option("--device", help=DEVICE_HELP, callback=device_checked)
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads [default: all cores].")
@click.option("--stream", is_flag=True, help="Print tokens as they are decoded.")
@click.option("--output", type=click.Path(dir_okay=False),
              help="Write results as JSONL here, a line each as it finishes (with its prompt's index).")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the artifact (trusted hosts only).")
@click.option("--prefix-cache-mib", type=click.FloatRange(min=0),
              help="Memory for the KV of prompt prefixes, reused by prompts that begin alike; 0 turns it off.")
@output_format_options
def main(artifact, variant, texts, prompts_file, chat, max_new_tokens, temperature, top_k, top_p, min_p,
         repetition_penalty, stop, num_beams, length_penalty, early_stopping, num_return_sequences, seed, batch_size,
         device, threads, stream, output, no_verify, prefix_cache_mib, json_schema, regex, choice, grammar) -> None:
    """Generate text with a compiled ARTIFACT folder."""
    from .generator import Generator
    from .sampling import SamplingParams
    from .structured import format_of_options

    unwind_on_sigterm()  # what finished is already in --output; say so and exit 143
    try:
        output_format = format_of_options(json_schema, regex, choice, grammar)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop),
                                num_beams=num_beams, length_penalty=length_penalty, n=num_return_sequences,
                                early_stopping={"false": False, "true": True}.get(early_stopping, early_stopping),
                                output_format=output_format)
    except ValueError as exc:
        click.echo(f"run-model: error: {exc}", err=True)
        sys.exit(2)
    try:
        prompts = _read_prompts(texts, prompts_file, chat)
        _check_output(output)
        generator = Generator.load(artifact, variant=variant, threads=threads, max_batch_size=batch_size,
                                   verify=not no_verify, device=device, prefix_cache_mib=prefix_cache_mib)
    except KilnError as exc:
        click.echo(f"run-model: error: {exc}", err=True)
        sys.exit(2)
    try:
        results = _run(generator, prompts, params, stream, output)
    except KeyboardInterrupt as exc:
        kept = f"; what finished is in {output}" if output else ""
        click.echo(f"run-model: interrupted{kept}", err=True)
        sys.exit(interrupted_exit_code(exc))
    if not stream:
        for index, result in enumerate(results):
            if result.error is None:
                _print(index, result, len(results) > 1)
    failed = [(i, r) for i, r in enumerate(results) if r.error is not None]
    for index, result in failed:
        click.echo(f"run-model: error: prompt {index}: {result.error}", err=True)
    sys.exit(1 if failed else 0)


def _print(index: int, result: Result, numbered: bool) -> None:
    if result.score is None:  # one sequence a prompt
        click.echo(f"[{index}] {result.text}" if numbered else result.text)
        return
    for rank, beam in enumerate([result, *result.alternatives]):  # beams, best first, with their scores
        click.echo(f"[{index}.{rank}] ({beam.score:.4f}) {beam.text}")


def _run(generator, prompts: list, params, stream: bool, output: str | None) -> list[Result]:
    """Every prompt's result (its other sequences in `alternatives`), in prompt order; each sequence is
    written to `output` the moment it finishes."""
    results: list[Result | None] = [None] * len(prompts)
    later: dict[int, dict[int, Result]] = {}  # sequences 1..n-1 by prompt
    good = [i for i, p in enumerate(prompts) if not isinstance(p, BadLine)]
    with open(output, "w") if output else contextlib.nullcontext() as handle:
        def finished(index: int, sequence: int, result: Result) -> None:
            if sequence == 0:
                results[index] = result
            else:
                later.setdefault(index, {})[sequence] = result
            if handle is not None:
                fields = {k: v for k, v in vars(result).items() if k != "alternatives"}
                handle.write(json.dumps({"index": index, "sequence": sequence, **fields}) + "\n")
                handle.flush()

        for index in sorted(set(range(len(prompts))) - set(good)):
            finished(index, 0, Result(error=prompts[index].error, finish_reason="error"))
        for event in generator.stream([prompts[i] for i in good], params):
            if stream and event.text:
                prefix = f"[{good[event.index]}] " if len(prompts) > 1 else ""
                click.echo(f"{prefix}{event.text}", nl=bool(prefix))
            if event.result is not None:
                finished(good[event.index], event.sequence, event.result)
    for index, sequences in later.items():
        results[index].alternatives = [sequences[k] for k in sorted(sequences)]
    if stream:
        click.echo()
    return results


if __name__ == "__main__":
    main()
