"""fastllm: fast LLM inference kernels and orchestration for PyTorch users.

``fastllm.ops`` holds the ops (registered as ``torch.ops.fastllm.*`` and dispatched per device),
``fastllm.reference`` their plain-PyTorch twins, ``fastllm.MaskCache`` the causal-mask cache and
``fastllm.SamplingParams`` / ``fastllm.sample_next_tokens`` the sampling step.
"""

import torch

from fastllm import _C

if _C.torch_version != torch.__version__:
    raise ImportError(
        f"fastllm was built against torch {_C.torch_version} but torch {torch.__version__} is "
        "installed; rebuild it with `pip install --no-build-isolation .`"
    )

from fastllm import ops, reference  # noqa: E402  (needs the op registry loaded above)
from fastllm.sampling import (  # noqa: E402
    SampleOutput,
    SamplingParams,
    SamplingTensors,
    sample_next_tokens,
)

MaskCache = _C.MaskCache

__all__ = ["MaskCache", "SampleOutput", "SamplingParams", "SamplingTensors", "ops", "reference",
           "sample_next_tokens"]
__version__ = "0.1.0"
