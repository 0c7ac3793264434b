"""One error type for problems the user can fix, and the entry-point wrapper that reports it."""
import sys
from typing import Callable, Optional, Sequence


class UserInputError(ValueError):
    """A problem with the user's input (config, data, checkpoint, device); the message names the fix."""


def run_cli(main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> None:
    """Run an entry point; report a UserInputError as one line on stderr and exit with code 2."""
    try:
        code = main(argv)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(code or 0)
