"""Skip marks for tests that need the CPU layers' library, or its bfloat16 convolutions. Importing
this asks the library for its bfloat16 layout, which fixes its ISA: a module that runs its own
functions under a cap (test_cpu_layers_native.py) keeps its own mark."""
import pytest

from src.cpu_layers import library, unavailable_reason

needs_library = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
needs_bf16_convolutions = pytest.mark.skipif(
    unavailable_reason() is not None or library.channels_per_block("bfloat16") == 0,
    reason="no bfloat16 convolutions in this CPU's oneDNN")
