"""OpenMP settings for this repository's CPU layers (src/cpu_layers). They must be in the
environment before MindSpore is imported: importing it loads GNU OpenMP, which reads them once."""
import os
from typing import MutableMapping, Optional

from src.cpu import is_x86

# After each parallel region GNU OpenMP's threads spin (300,000 turns by default) waiting for the
# next one. Between our kernels MindSpore runs its own on its thread pool, and on a 2-core machine
# the spinning threads took their cores: a ResNet50 8x224 training step took ~1,040 ms with the
# default and ~960 ms with 10,000 turns (Intel Xeon, 2 threads); MindSpore's convolutions, which
# do not use OpenMP, ran the same either way.
SPIN_COUNT = "10000"


def set_openmp_environment(environ: Optional[MutableMapping[str, str]] = None,
                           machine_name: Optional[str] = None) -> None:
    """GOMP_SPINCOUNT, unless the user set it, on x86 where our layers run (`machine_name` stands in
    for this machine's architecture); call before the first `import mindspore`."""
    if is_x86(machine_name):
        (os.environ if environ is None else environ).setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
