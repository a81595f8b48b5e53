"""Errors a user can hit, each with one clear line and a distinct exit code.

Shared by the compiler and the runtime (the artifact is their one contract), so the runtime
never needs to import the compiler to report a problem.
"""
from __future__ import annotations

import functools
import importlib
import sys


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


class BackendMissingError(KestrelError):
    """An optional backend's library is not installed here (TensorRT for --backend tensorrt)."""

    exit_code = 9


def import_optional(module: str, missing: str):
    """An optional backend's module (onnx, tensorrt), or BackendMissingError with ``missing``
    (``{error}`` in it is replaced by the ImportError)."""

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendMissingError(missing.format(error=e)) from None


def exit_on_error(fn):
    """Wrap a CLI entry point: a KestrelError becomes one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KestrelError as e:
            print(f"error: {e.message}", file=sys.stderr)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
