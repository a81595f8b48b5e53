"""Errors a user can hit, each with one clear line and a distinct exit code.

Shared by the compiler and the runtime (the artifact is their one contract), so the runtime
never needs to import the compiler to report a problem.
"""
from __future__ import annotations

import functools
import importlib
import signal
import sys
import threading

import click


class KestrelError(Exception):
    """Base class: ``str(err)`` is the one line shown to the user; ``exit_code`` is distinct per kind."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(KestrelError):
    """config.json is missing, unreadable, of an unknown model_type, or inconsistent."""

    exit_code = 3


class CheckpointError(KestrelError):
    """A checkpoint tensor is missing, misshapen, of an unsupported dtype, or unexpected."""

    exit_code = 4


class ArtifactError(KestrelError):
    """A .plan file is truncated, altered, of another format version, or otherwise invalid."""

    exit_code = 5


class InputError(KestrelError):
    """A run request the plan cannot serve (prompt longer than max_seq, no tokenizer, ...)."""

    exit_code = 6


class UnsupportedError(KestrelError):
    """A valid request for something this build of Kestrel does not do (yet)."""

    exit_code = 7


class DeviceError(KestrelError):
    """No CUDA driver, wrong GPU architecture, or a device-side failure."""

    exit_code = 8


class OutputError(KestrelError):
    """An output path that must not or cannot be written: not a regular file, a file the command reads,
    a folder that does not exist or is not writable, a disk that filled up while writing."""

    exit_code = 10


class BackendMissingError(KestrelError):
    """An optional backend's library is not installed here (TensorRT for --backend tensorrt)."""

    exit_code = 9


class DoesNotFitError(KestrelError):
    """The plan's arena is larger than the memory of the largest GPU of its target (or, at load, than the
    device's free memory): said before any allocation fails."""

    exit_code = 12


class NoDraftHeadError(KestrelError):
    """Speculative decoding asked of a model that has no draft head (``--speculative mtp`` on a
    checkpoint without multi-token-prediction tensors)."""

    exit_code = 11


class DraftSourceError(KestrelError):
    """``kestrel-run --draft-source replay:FILE``: the file is missing, unreadable, not a ``--json`` output
    with tokens, or for another prompt; or the plan has no speculative programs to replay into."""

    exit_code = 13


def import_optional(module: str, missing: str):
    """An optional backend's module (onnx, tensorrt), or BackendMissingError with ``missing``
    (``{error}`` in it is replaced by the ImportError)."""

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendMissingError(missing.format(error=e)) from None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # handled like Ctrl-C (SIGINT)


_stopped_by: list[int] = []  # the stop signal received, if any


def _stop(signum, frame):
    _stopped_by.append(signum)
    raise KeyboardInterrupt(signum)


def exit_on_error(fn):
    """Wrap a CLI entry point: a KestrelError becomes one line on stderr and its exit code. Ctrl-C,
    SIGTERM and SIGHUP stop the command the same way — every writer's cleanup runs (no partial file is
    left behind) — and exit with 128 + the signal's number."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            # SIGINT too: recorded, so a Ctrl-C whose KeyboardInterrupt a library turns into another
            # exception (safetensors mid-read) still exits as an interrupt
            for s in STOP_SIGNALS + (signal.SIGINT,):
                signal.signal(s, _stop)
        try:
            return fn(*args, **kwargs)
        except KestrelError as e:
            print(f"error: {e.message}", file=sys.stderr)
            sys.exit(e.exit_code)
        except KeyboardInterrupt as e:
            _interrupted(e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)
        except Exception:
            # a stop signal's KeyboardInterrupt raised inside a library (torch, safetensors) can come out
            # as another exception: the writers' cleanup has run all the same
            if _stopped_by:
                _interrupted(_stopped_by[-1])
            raise

    return wrapper


def _interrupted(signum: int):
    print(f"interrupted ({signal.Signals(signum).name}); nothing was left half-written", file=sys.stderr)
    sys.exit(128 + signum)


def run_command(command, prog_name: str) -> None:
    """Run a click command as a console entry point with Kestrel's error style: a usage error (an
    unknown option, a bad value, a missing argument) is one ``error:`` line naming what is valid,
    exit code 2 — never click's multi-line usage block."""
    try:
        code = command.main(prog_name=prog_name, standalone_mode=False)
    except click.UsageError as e:
        print(f"error: {e.format_message()} (see {prog_name}{_subcommand(e)} --help)", file=sys.stderr)
        sys.exit(2)
    except click.Abort:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _subcommand(e) -> str:
    ctx = getattr(e, "ctx", None)
    return f" {ctx.info_name}" if ctx is not None and ctx.parent is not None else ""
