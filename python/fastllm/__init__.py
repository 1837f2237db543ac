"""fastllm: fast LLM inference kernels and orchestration for PyTorch users.

``fastllm.ops`` holds the ops (registered as ``torch.ops.fastllm.*`` and dispatched per device),
``fastllm.reference`` their plain-PyTorch twins, and ``fastllm.MaskCache`` the causal-mask cache.
"""

import torch

from fastllm import _C

if _C.torch_version != torch.__version__:
    raise ImportError(
        f"fastllm was built against torch {_C.torch_version} but torch {torch.__version__} is "
        "installed; rebuild it with `pip install --no-build-isolation .`"
    )

from fastllm import ops, reference  # noqa: E402  (needs the op registry loaded above)

MaskCache = _C.MaskCache

__all__ = ["MaskCache", "ops", "reference"]
__version__ = "0.1.0"
