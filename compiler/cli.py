"""compile-model RECIPE [--out DIR] [--variant NAME ...] [--keep-failed] [--debug]"""

from __future__ import annotations

import logging
import signal
import sys

import click

from runtime.errors import KilnError

from .errors import CheckpointError, OutputError, RecipeError

# Bad input (exit 2) versus a compile that ran and failed (exit 1, e.g. ExportMismatch).
BAD_INPUT = (RecipeError, CheckpointError, OutputError)


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so the staging folder is removed on the way out.
    raise KeyboardInterrupt


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--out", "out", type=click.Path(file_okay=False), help="Artifact folder [default: out/<recipe name>].")
@click.option("--variant", "variants", multiple=True, metavar="NAME", help="Build only this variant (repeatable).")
@click.option("--keep-failed", is_flag=True,
              help="Keep variants that miss their accuracy gates, marked failed in the manifest, and exit 0.")
@click.option("--debug", is_flag=True, help="Show full tracebacks and the exporter's own output.")
def main(recipe: str, out: str | None, variants: tuple[str, ...], keep_failed: bool, debug: bool) -> None:
    """Compile the model a RECIPE names into a validated artifact folder."""
    from .pipeline import compile_recipe  # heavy imports only once the arguments are known good

    # Claim the root logger first: ONNX Runtime's quantization tools call logging.basicConfig(INFO) on
    # import and would print every node they skip. Libraries' warnings are for --debug too.
    logging.basicConfig(level=logging.INFO if debug else logging.ERROR)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        folder = compile_recipe(recipe, out, variants, debug=debug, keep_failed=keep_failed)
    except KilnError as exc:
        if debug:
            raise
        click.echo(f"compile-model: error: {exc}", err=True)
        sys.exit(2 if isinstance(exc, BAD_INPUT) else 1)
    except KeyboardInterrupt:
        click.echo("compile-model: interrupted; nothing was written", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug of ours or a library's: still one line unless --debug
        if debug:
            raise
        click.echo(f"compile-model: internal error: {type(exc).__name__}: {exc} (rerun with --debug)", err=True)
        sys.exit(1)
    click.echo(str(folder))


if __name__ == "__main__":
    main()
