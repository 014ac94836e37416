"""Kernel tests run the Triton kernels in the interpreter when there is no CUDA.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before
this directory's test modules import pddgw.kernels.triton_ops; if another test
directory imported it first (compiled-mode kernels), it is reloaded.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _loaded = sys.modules.get("pddgw.kernels.triton_ops")
    if _loaded is not None and type(_loaded._attn_fwd_kernel).__name__ != "InterpretedFunction":
        importlib.reload(_loaded)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny tensors here gain nothing from intra-op threads, and on a shared
    2-core machine spinning thread pools make them 100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
