"""flashlab: build FlashAttention-2 in Triton, from naive attention up.

``flashlab.device`` is imported first: it decides between the GPU and Triton's
CPU interpreter before any kernel is defined.  Without Triton (macOS, Windows) the
package still imports: the NumPy references, the grader's NumPy exercises and the
figures work, and everything that needs a kernel raises ``device.TritonMissing``
with a message that says so and offers Colab.
"""
from . import device  # noqa: F401  (must come first)
from . import reference  # noqa: F401

if device.TRITON:
    from .attention import flash_attention  # noqa: F401
    from .variants import flash_attention_varlen  # noqa: F401  (registers torch.ops.flashlab.variant_*)
    from .decode import flash_decode  # noqa: F401
    from .fp8 import flash_attention_fp8, quantize_fp8  # noqa: F401
    from . import op  # noqa: F401  (registers torch.ops.flashlab.attention_forward/backward)
else:
    def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, **kwargs):
        """FlashAttention-2 in Triton: not available here, because Triton is not installed."""
        device.require_triton("flashlab.flash_attention")

    def flash_attention_varlen(*args, **kwargs):
        """Attention over packed sequences in Triton: not available here, because Triton is not installed."""
        device.require_triton("flashlab.flash_attention_varlen")

    def flash_decode(q, k_cache, v_cache, cache_seqlens=None, *, block_table=None, is_causal: bool = False,
                     scale=None, softcap=None, window=None, num_splits=None, return_lse: bool = False):
        """Split-KV decoding in Triton: not available here, because Triton is not installed."""
        device.require_triton("flashlab.flash_decode")

    def flash_attention_fp8(q8, k8, vt8, q_scale, k_scale, v_scale, is_causal=False, scale=None, **kwargs):
        """The FP8 forward in Triton: not available here, because Triton is not installed."""
        device.require_triton("flashlab.flash_attention_fp8")

    def quantize_fp8(t, *, transpose=False):
        """e4m3 quantisation for the FP8 forward: not available here, because Triton is not installed."""
        device.require_triton("flashlab.quantize_fp8")

__version__ = "0.1.0"
__all__ = ["device", "reference", "flash_attention", "flash_attention_varlen", "flash_decode", "flash_attention_fp8",
           "quantize_fp8", "__version__"]

device.register_magics()
