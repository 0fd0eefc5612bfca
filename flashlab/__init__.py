"""flashlab: build FlashAttention-2 in Triton, from naive attention up.

``flashlab.device`` is imported first: it decides between the GPU and Triton's
CPU interpreter before any kernel is defined.
"""
from . import device  # noqa: F401  (must come first)
from . import reference  # noqa: F401
from .attention import flash_attention  # noqa: F401
from . import op  # noqa: F401  (registers torch.ops.flashlab.attention_forward/backward)

__version__ = "0.1.0"
__all__ = ["device", "reference", "flash_attention", "__version__"]
