"""Writing run files safely: through a hidden temporary and a rename, with write failures (disk
full, permissions, a vanished folder) reported as one line naming the file, and leftovers of
killed runs cleaned up at start."""
import contextlib
import os
import shutil
from typing import Callable, Iterator, List, Optional

from src.errors import UserInputError

# Every temporary file this project writes starts with this prefix, so a later run can tell its
# own leftovers from anything else in the run folder.
TMP_PREFIX = ".tmp-"


class WriteError(UserInputError):
    """A run file could not be written; the message names the file and the cause."""


def write_failure(path: str, err: BaseException) -> WriteError:
    """The one-line error for a failed write of `path`."""
    cause = err.strerror if isinstance(err, OSError) and err.strerror else str(err).strip().splitlines()[0]
    return WriteError(f"cannot write {path}: {cause}; earlier files in {os.path.dirname(path) or '.'} are "
                      f"intact (free space or fix permissions; a training run then continues with --resume True)")


def temporary_path(path: str) -> str:
    """The hidden temporary name `path` is written under before the rename."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}-{name}")


@contextlib.contextmanager
def atomic_target(path: str, tmp: Optional[str] = None) -> Iterator[str]:
    """Yield a temporary path to write (`tmp`, default `temporary_path(path)`); on success it
    replaces `path`. On any failure the temporary is removed, `path` keeps its old content, and an
    OSError becomes a WriteError naming `path`."""
    tmp = tmp or temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        raise write_failure(path, err) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def write_atomic(path: str, text: str) -> None:
    """Write text to path through a temporary file and a rename, so readers never see half a file;
    a failed write is one WriteError naming `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise write_failure(path, err) from None
    with atomic_target(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)


def remove_stale_temporaries(folder: str) -> List[str]:
    """Remove our own temporary files (TMP_PREFIX) left in `folder` by killed runs; returns them."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for entry in os.scandir(folder):
        if entry.name.startswith(TMP_PREFIX) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.remove(entry.path)
                removed.append(entry.name)
    return sorted(removed)


def warn_if_low_space(folder: str, expected_bytes: int, log: Callable[[str], None]) -> Optional[int]:
    """Log a warning when `folder` has less free space than `expected_bytes`; returns the free bytes."""
    if expected_bytes <= 0 or not os.path.isdir(folder):
        return None
    free = shutil.disk_usage(folder).free
    if free < expected_bytes:
        log(f"warning: {free / 2**20:.1f} MiB free in {folder}, less than the last checkpoint "
            f"({expected_bytes / 2**20:.1f} MiB); the next save may fail")
    return free
