"""How an error reaches the user of the CLI: one line naming what is wrong (no traceback).

:func:`describe` turns an exception into ``error:`` lines and an exit code; :class:`ErrorHandlingGroup`
applies it to every ``trakflow`` command. ``trakflow --debug`` (or ``TRAKFLOW_DEBUG=1``) lets the exception
through instead, with its traceback. No Prefect, pydantic or httpx import at module level.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

import click
import typer
import typer.core

#: prefixes pydantic puts before the message of an error raised in a validator
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")
#: modules whose exceptions only wrap the one that the task or flow raised
_WRAPPERS = ("prefect.", "prefect_dask.", "distributed.", "concurrent.futures", "anyio.")
#: the exit code of errors in what the user gave (a config, an argument, a store made with other settings)
INPUT_EXIT = 2


@dataclass
class Described:
    """What to print for an exception: its lines (each printed after ``error:``), the exit code, and whether
    it is a failure we expect (a known error type) rather than a bug (then the hint offers --debug)."""

    lines: list[str]
    code: int
    expected: bool = True


#: loc parts pydantic adds for the members of a union (``lambda_reg.constrained-float``, ``x.list[str]``)
_UNION_TAGS = {"str", "int", "float", "bool", "bytes", "none", "dict", "list", "tuple", "set", "is-instance"}


def _is_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or "-" in part or part in _UNION_TAGS)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if _is_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: dict, field: str) -> str:
    msg = str(err.get("msg", "")).strip()
    for p in _PYDANTIC_PREFIXES:
        if msg.startswith(p):
            msg = msg[len(p) :]
    for name in filter(None, (field, field.rsplit(".", 1)[-1])):
        if msg.startswith(name + ": "):
            return msg[len(name) + 2 :]
    return msg


def validation_lines(exc, where: str = "") -> list[str]:
    """One ``field.path: message`` line per field of a pydantic ``ValidationError`` (no input dump, no link;
    the members of a union that all failed on one line); ``where`` (e.g. ``invalid config c.yaml: ``) starts
    each line. A short scalar input is quoted after the message when the message does not show it already."""
    by_field: dict[str, list[dict]] = {}
    for err in exc.errors(include_url=False):
        by_field.setdefault(_loc(tuple(err.get("loc") or ())), []).append(err)
    lines = []
    for field, errs in by_field.items():
        msgs = list(dict.fromkeys(_message(e, field) for e in errs))
        msg = " or ".join(msgs)
        value = errs[0].get("input")
        if isinstance(value, (int, float, str, bool)):
            shown = repr(value)
            if len(shown) <= 60 and not (isinstance(value, str) and value in msg):
                msg += f" (got {shown})"
        msg = " ".join(msg.split())
        if not field and re.match(r"[\w.\[\]]+: ", msg):  # a model validator's message names its field(s)
            lines.append(f"{where}{msg}")
        else:
            lines.append(f"{where}{field or exc.title}: {msg}")
    return lines or [f"{where}{exc.title}: {exc}"]


def _is_wrapper(exc: BaseException) -> bool:
    mod = type(exc).__module__ + "."
    return mod.startswith(_WRAPPERS) or isinstance(exc, BaseExceptionGroup)


def root_cause(exc: BaseException) -> BaseException:
    """The error behind ``exc``: through Prefect's (and the executors') wrapper exceptions, one-member
    exception groups and explicit ``raise ... from`` chains. trakflow's own errors (TrakError) already name
    their cause and end the search."""
    from trak_core.errors import TrakError

    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TrakError):
            break
        if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
            continue
        implicit = None if exc.__suppress_context__ else exc.__context__
        inner = exc.__cause__ or (implicit if _is_wrapper(exc) else None)
        if inner is None:
            break
        exc = inner
    return exc


def _one_line(exc: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):  # field: message, without pydantic's input dump and link
        return f"ValidationError: {'; '.join(validation_lines(exc))}"
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def error_line(exc: BaseException) -> str:
    """``Type: message`` of the root cause, on one line; the outer error it was raised as, when that is not
    a mere wrapper, in brackets. A full disk (ENOSPC) says so and names the path."""
    cause = root_cause(exc)
    line = _one_line(cause)
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        where = f" writing {cause.filename}" if cause.filename else ""
        line += (
            f" — the disk is full{where}; free space (or move the store), then rerun: what was written is "
            "kept (not retried)"
        )
    outer = exc
    while outer is not cause and _is_wrapper(outer):
        outer = outer.__cause__ or outer.__context__ or cause
    if outer is not cause:
        line += f" (raised as {_one_line(outer)})"
    return line


def api_url() -> str:
    """The Prefect API this process talks to (PREFECT_API_URL), or a phrase for the ephemeral server."""
    return os.environ.get("PREFECT_API_URL") or "Prefect's ephemeral server (PREFECT_API_URL is not set)"


def _http_lines(exc) -> list[str] | None:
    """A Prefect/httpx error talking to the API, or None."""
    import httpx

    if isinstance(exc, httpx.TransportError):  # connect refused, DNS, timeout, TLS
        url = os.environ.get("PREFECT_API_URL")
        if not url:
            try:
                url = str(exc.request.url)
            except RuntimeError:  # an error raised without its request
                url = api_url()
        what = "did not answer in time" if isinstance(exc, httpx.TimeoutException) else "cannot be reached"
        return [
            f"the Prefect API at {url} {what} ({type(exc).__name__}: {' '.join(str(exc).split())}): start the "
            "server (`prefect server start`) or set PREFECT_API_URL to one that answers"
        ]
    if isinstance(exc, httpx.HTTPStatusError):
        status, url = exc.response.status_code, str(exc.request.url)
        if status in (401, 403):
            return [
                f"the Prefect API at {url} refused the request ({status} {exc.response.reason_phrase}): set "
                "PREFECT_API_AUTH_STRING (user:password) to the server's PREFECT_SERVER_API_AUTH_STRING"
            ]
        detail = " ".join(exc.response.text.split())[:300]
        return [f"the Prefect API at {url} answered {status} {exc.response.reason_phrase}: {detail}"]
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (causes and contexts), outermost first."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def describe(exc: BaseException) -> Described:
    """The ``error:`` lines and exit code for ``exc`` (any exception; the root cause of wrapped ones)."""
    from pydantic import ValidationError

    from trak_core.errors import BadInputError, StoreMismatchError, TrakError

    cause = root_cause(exc)
    if isinstance(cause, ValidationError):
        if cause.title == "StoreMetadata":  # read from a store: the store is damaged, not the input
            where = "a store's trakflow metadata is malformed (root zarr.json, attribute 'trakflow'): "
            return Described(validation_lines(cause, where), 1)
        return Described(validation_lines(cause, f"invalid {cause.title}: "), INPUT_EXIT)
    if isinstance(cause, (BadInputError, StoreMismatchError)):
        return Described([error_line(exc)], INPUT_EXIT)
    if isinstance(cause, TrakError):
        return Described([error_line(exc)], 1)
    for e in _chain(exc):  # an httpx error wraps httpcore's: name the API, not the transport
        http = _http_lines(e)
        if http is not None:
            return Described(http, 1)
    if isinstance(cause, (OSError, MemoryError)):  # a file, a disk, the network: the message names it
        return Described([error_line(exc)], 1)
    return Described([error_line(exc)], 1, expected=False)


def _click_exceptions(name: str) -> tuple[type, ...]:
    """click's exception class ``name`` and, where typer vendors its own click (typer ≥ 0.24), typer's."""
    mods = [click.exceptions]
    try:
        import typer._click.exceptions as vendored

        mods.append(vendored)
    except ImportError:
        pass
    return tuple(c for m in mods if (c := getattr(m, name, None)) is not None)


_USAGE_ERRORS = _click_exceptions("UsageError")
_NO_ARGS_HELP = _click_exceptions("NoArgsIsHelpError")  # `trakflow` alone prints the help
_CLICK_ERRORS = _click_exceptions("ClickException")


def usage_line(exc: Exception, ctx: click.Context | None) -> str:
    """A usage mistake (unknown option or command, missing or extra argument) as one line naming the command;
    extra arguments after an option that takes one value say how to give several."""
    msg = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
    ctx = getattr(exc, "ctx", None) or ctx
    cmd = getattr(ctx, "command", None)
    if "unexpected extra argument" in msg and cmd is not None:
        multi = [p.opts[0] for p in cmd.params if getattr(p, "multiple", False) and getattr(p, "opts", None)]
        if multi:
            msg += f" (an option taking several values is repeated: {multi[0]} A {multi[0]} B)"
    where = " ".join(["trakflow", *(ctx.command_path.split()[1:] if ctx is not None else [])])  # any prog name
    return f"{where}: {msg} (see `{where} --help`)"


class ErrorHandlingGroup(typer.core.TyperGroup):
    """The ``trakflow`` command group: an exception escaping a command is printed as ``error:`` lines
    (:func:`describe`) and the CLI exits with its code; a usage mistake (unknown option or command, a missing or
    extra argument) is one ``error:`` line, exit 2; with ``--debug`` an exception propagates (traceback)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _NO_ARGS_HELP:
            raise
        except _USAGE_ERRORS as e:  # the group's own options (`trakflow --nope`)
            print_error([usage_line(e, None)])
            raise typer.Exit(INPUT_EXIT) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except _NO_ARGS_HELP:
            raise
        except _USAGE_ERRORS as e:
            print_error([usage_line(e, ctx)])
            raise typer.Exit(INPUT_EXIT) from None
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, *_CLICK_ERRORS):
            raise
        except Exception as e:
            if debug_enabled(ctx):
                raise
            d = describe(e)
            print_error(d.lines)
            if not d.expected:
                print_error(["(an unexpected error: `trakflow --debug ...` shows its traceback)"], prefix="")
            raise typer.Exit(d.code) from None


def debug_enabled(ctx: click.Context | None = None) -> bool:
    """``trakflow --debug`` (the root command's option) or ``TRAKFLOW_DEBUG`` set to a true value."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().params.get("debug"):
        return True
    return os.environ.get("TRAKFLOW_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def print_error(lines: list[str], prefix: str = "[bold red]error:[/] ") -> None:
    """Each line on stderr, unwrapped (a long path stays on its line), markup in the text escaped."""
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, soft_wrap=True)
    for line in lines:
        err.print(f"{prefix}{escape(line)}" if prefix else f"[dim]{escape(line)}[/]", soft_wrap=True, highlight=False)
