"""The compiled library (native/libresnet_conv.so): where it is, whether it loads, its settings."""
import ctypes
import os
from typing import Optional

from src.cpu import is_x86, machine

NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
LIBRARY = os.path.join(NATIVE_DIR, "libresnet_conv.so")
ONEDNN_VERSION = 30200  # the onednn-cpu-gomp 2023.2.0 package: oneDNN 3.2.0
BUILD_HINT = "bash scripts/setup_env.sh builds it (it needs g++ and the onednn-devel-cpu-gomp package)"


def load_library() -> ctypes.CDLL:
    """The library, loaded once per process (the same handle MindSpore's Custom ops get)."""
    return ctypes.CDLL(LIBRARY)


def unavailable_reason() -> Optional[str]:
    """None when the library is built, loads and runs its own oneDNN; else why not, in one phrase."""
    if not is_x86():
        return (f"they need an x86_64 CPU (oneDNN's CPU wheels are built for x86_64 only; this is "
                f"{machine()})")
    if not os.path.isfile(LIBRARY):
        build_log = os.path.join(NATIVE_DIR, "build.log")
        return (f"{LIBRARY} is not built" + (f" (see {build_log})" if os.path.isfile(build_log) else "")
                + f"; {BUILD_HINT}")
    try:
        library = load_library()
    except OSError as error:
        return f"{LIBRARY} does not load ({error}); {BUILD_HINT}"
    version = library.OneDnnVersion()
    if version != ONEDNN_VERSION:  # bound to another libdnnl.so.3 (MindSpore's): the SONAME trick failed
        return f"{LIBRARY} runs oneDNN {version} instead of its private copy {ONEDNN_VERSION}; {BUILD_HINT}"
    return None


def set_threads(threads: int) -> None:
    """Threads per convolution (0: OpenMP's default, the cores this process may use)."""
    load_library().SetThreads(int(threads))


def last_error() -> str:
    """The library's message for the last kernel that returned an error."""
    function = load_library().LastError
    function.restype = ctypes.c_char_p
    return function().decode()
