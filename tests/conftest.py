import os
import sys
from pathlib import Path

import pytest

# tests import their helpers (synthetic.py) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))
# no test may reach a model hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def ggml():
    """llama-cpp-python's ggml (``quants_ggml.GGML``): its quantizers, to_float and vec_dot."""
    from quants_ggml import load as load_ggml

    lib = load_ggml()
    if lib is None:
        pytest.skip("needs llama-cpp-python's ggml (peers extra)")
    return lib


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    """The default model's file (SmolLM2 Q4_1), or a skip where it is not installed (the set-up
    commands install it; a GPU machine has it only when staged)."""
    from qlib import models

    try:
        return models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))
