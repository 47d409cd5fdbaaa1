"""Off the product path: RoPE at arbitrary positions, HF's ``apply_rotary_pos_emb`` fused, key
re-rotation, and the Liger-style patch that swaps HF's function for the fused one
(:mod:`.rope_patch`). Nothing in the engine calls them (it moves blocks with
:func:`pckernels.ops.gather_rotate`); they are kept working and tested.

Layout as for the product kernels: :mod:`.rope` (checks, torch-native paths, the entry to the
Triton kernel in ``rope/kernel.py``), ``rope/naive.py`` (references), :mod:`.ops` (the
registered ops and this API).
"""

from pckernels.extras.ops import apply_rotary_pos_emb, rerotate_block, rerotate_keys, rope_at_positions

__all__ = ["apply_rotary_pos_emb", "rerotate_block", "rerotate_keys", "rope_at_positions"]
