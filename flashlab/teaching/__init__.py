"""Teaching variants: kernels that show an idea, deliberately kept off ``flashlab.flash_attention``'s path.

``atomic_dq``  a one-pass backward that adds dQ with atomics: fewer recomputed scores, but the
               sum's order (and so its last bits) changes from run to run on a GPU (notebook 07).
``fa1_forward`` FlashAttention-1's loop order (K/V tiles outside, O, m, l through HBM each step), and
               FA2's forward with its programs in a chosen order, for the L2 experiment (notebook 06).
"""
