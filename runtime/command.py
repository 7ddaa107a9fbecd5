"""click commands whose errors are one line: `PROG: error: what is wrong`, the exit code click gives
(2 for a bad command line), never click's three-line usage block. Every Kiln command uses these."""

from __future__ import annotations

import sys
from typing import Any

import click

from .errors import interrupted_exit_code


def _one_line_main(command: click.Command, main: Any, args: Any, prog_name: str | None, extra: dict) -> None:
    extra.pop("standalone_mode", None)
    name = prog_name or command.name
    try:
        code = main(args, prog_name or command.name, standalone_mode=False, **extra)
    except click.ClickException as exc:
        ctx = getattr(exc, "ctx", None)
        if ctx is not None and ctx.command is not command and isinstance(command, click.Group):
            name = f"{name} {ctx.info_name}"  # a subcommand's bad option names the subcommand
        click.echo(f"{name}: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort as exc:  # Ctrl-C or SIGTERM (unwind_on_sigterm) that the command left to click
        cause = exc.__cause__ if isinstance(exc.__cause__, KeyboardInterrupt) else KeyboardInterrupt()
        click.echo(f"{name}: interrupted", err=True)
        sys.exit(interrupted_exit_code(cause))
    sys.exit(code if isinstance(code, int) else 0)


class OneLineCommand(click.Command):
    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> None:
        _one_line_main(self, super().main, args, prog_name, extra)


class OneLineGroup(click.Group):
    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> None:
        _one_line_main(self, super().main, args, prog_name, extra)


def output_format_options(command):
    """--json-schema FILE | --regex R | --choice A,B,C | --grammar FILE, for run-model and kiln batch."""
    options = (
        click.option("--json-schema", metavar="FILE", help="Answer JSON that validates against this JSON Schema."),
        click.option("--regex", metavar="R", help="Answer text that matches this regular expression."),
        click.option("--choice", metavar="A,B,C", help="Answer exactly one of these comma-separated strings."),
        click.option("--grammar", metavar="FILE", help="Answer text in this grammar (Lark, or llama.cpp's GBNF)."),
    )
    for option in reversed(options):
        command = option(command)
    return command
