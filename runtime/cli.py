"""run-model ARTIFACT [--prompt TEXT ...] [--prompts-file FILE.jsonl] [--chat] [sampling options]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .errors import KilnError


def _read_prompts(texts: tuple[str, ...], prompts_file: str | None, chat: bool) -> list:
    prompts: list = list(texts)
    if prompts_file:
        for number, line in enumerate(Path(prompts_file).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise click.UsageError(f"{prompts_file}:{number}: not JSON ({exc.msg})") from None
            prompts.append(record if isinstance(record, str) else record.get("messages") or record.get("prompt", ""))
    if chat:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise click.UsageError("give at least one --prompt or a --prompts-file")
    return prompts


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path())
@click.option("--variant", help="Variant to run [default: the first built one].")
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
@click.option("--seed", type=int, help="Seed for sampling; each prompt's draws are reproducible.")
@click.option("--batch-size", default=32, show_default=True, help="Largest batch decoded at once.")
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads [default: all cores].")
@click.option("--stream", is_flag=True, help="Print tokens as they are decoded.")
@click.option("--output", type=click.Path(dir_okay=False), help="Write results as JSONL here.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the artifact (trusted hosts only).")
def main(artifact, variant, texts, prompts_file, chat, max_new_tokens, temperature, top_k, top_p, min_p,
         repetition_penalty, stop, seed, batch_size, threads, stream, output, no_verify) -> None:
    """Generate text with a compiled ARTIFACT folder."""
    from .generator import Generator
    from .sampling import SamplingParams

    prompts = _read_prompts(texts, prompts_file, chat)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop))
    try:
        generator = Generator.load(artifact, variant=variant, threads=threads, max_batch_size=batch_size,
                                   verify=not no_verify)
    except KilnError as exc:
        click.echo(f"run-model: error: {exc}", err=True)
        sys.exit(2)
    if stream:
        results = _stream(generator, prompts, params)
    else:
        results = generator.generate(prompts, params)
        for index, result in enumerate(results):
            if result.error is None:
                header = f"[{index}] " if len(results) > 1 else ""
                click.echo(f"{header}{result.text}")
    failed = [(i, r) for i, r in enumerate(results) if r.error is not None]
    for index, result in failed:
        click.echo(f"run-model: error: prompt {index}: {result.error}", err=True)
    if output:
        with open(output, "w") as handle:
            for index, result in enumerate(results):
                handle.write(json.dumps({"index": index, **vars(result)}) + "\n")
    sys.exit(1 if failed else 0)


def _stream(generator, prompts, params) -> list:
    results = [None] * len(prompts)
    for event in generator.stream(prompts, params):
        if event.text:
            prefix = f"[{event.index}] " if len(prompts) > 1 else ""
            click.echo(f"{prefix}{event.text}", nl=bool(prefix))
        if event.result is not None:
            results[event.index] = event.result
    click.echo()
    return results


if __name__ == "__main__":
    main()
