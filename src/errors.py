"""One error type for problems the user can fix, and the entry-point wrapper that reports it."""
import argparse
import gc
import importlib
import logging
import os
import re
import sys
import traceback
from typing import Callable, List, NoReturn, Optional, Sequence


class UserInputError(ValueError):
    """A problem with the user's input (config, data, checkpoint, device); the message names the fix."""


# The data pipeline re-raises errors from our Python sources inside its own RuntimeError text.
_WRAPPED = re.compile(r"UserInputError: (?!Traceback)(.+)")


# Native kernels (src/cpu_layers) keep their failure's message until asked: MindSpore's own
# error says only that a custom operator failed. The package registers how to ask when a run uses it.
_NATIVE_ERRORS: List[Callable[[], str]] = []


def explain_native_errors_with(take_message: Callable[[], str]) -> None:
    """Let user_error_message ask `take_message` for the one-line message of a failed native kernel."""
    if take_message not in _NATIVE_ERRORS:
        _NATIVE_ERRORS.append(take_message)


def user_error_message(err: BaseException) -> Optional[str]:
    """The one-line message of a UserInputError, also when MindSpore's data pipeline wrapped it, or
    of a native kernel that failed under a RuntimeError."""
    if isinstance(err, UserInputError):
        return str(err)
    found = _WRAPPED.findall(str(err))
    if found:
        return found[-1].strip()
    if isinstance(err, RuntimeError):
        for take_message in _NATIVE_ERRORS:
            message = take_message()
            if message:
                return f"a CPU layer failed: {message}"
    return None


def require_module(name: str, *, needed_for: str, install_hint: str):
    """Import an optional dependency where it is used, or raise a one-line error saying how to
    install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UserInputError(f"{needed_for} needs {name}, which is not installed; {install_hint}") from None


def run_cli(main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> None:
    """Run an entry point; report a user error as one line on stderr and exit with code 2."""
    # What is loaded by now (MindSpore's modules: most of the heap) lives as long as the process.
    # Frozen, it is no longer walked by every collection the graph compile's allocations set off:
    # a small training run takes ~9% less CPU. The entry points that launchers start import with the
    # collector off (`gc.disable()` first thing: its collections during the imports found nothing
    # to free, and cost train.py's start ~0.3 of ~1.5 CPU-s); it collects again from here.
    gc.freeze()
    gc.enable()
    try:
        code = main(argv)
    except (UserInputError, RuntimeError) as err:
        message = user_error_message(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(code or 0)


def end_process_now(code: int = 1) -> NoReturn:
    """Write the exception being handled, as an uncaught one would be, and end the process at once:
    for failures after which a library's threads would hold the interpreter's exit (its shutdown
    joins them), so the process lingers though nothing is left to do."""
    traceback.print_exc()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are the project's one-line user errors (exit code 2)."""

    def error(self, message: str):
        raise UserInputError(f"{message}; see {self.prog} --help")
