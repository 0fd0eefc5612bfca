"""Teaching variants: kernels that show an idea, deliberately kept off ``flashlab.flash_attention``'s path.

``atomic_dq``  a one-pass backward that adds dQ with atomics: fewer recomputed scores, but the
               sum's order (and so its last bits) changes from run to run on a GPU (notebook 07).
``fa1_forward`` FlashAttention-1's loop order (K/V tiles outside, O, m, l through HBM each step), and
               FA2's forward with its programs in a chosen order, for the L2 experiment (notebook 06).
``one_head``   the smallest FA2 forward (one head, no mask, no LSE): notebook 05 builds it in the lecture.
``staged_forward`` the answers to notebook 05's staged exercises (tails and strides, then causal skipping).
``versions``   which forward and backward versions the op runs, and whether its dQ repeats, said from the
               launch plan (flashlab.kernels.plan) so that the notebooks' sentences follow the code.
``ceiling``    one measured matmul ceiling per run (the dtype of the kernels compared), reused by every
               "% of peak" of a notebook.
"""
