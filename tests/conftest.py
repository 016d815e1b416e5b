import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter, which must be chosen before triton is
# first imported: here, ahead of any test module (one that merely probes triton at collection
# would otherwise fix the compiled mode for the modules after it).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
