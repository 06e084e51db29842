"""Linear-attention operators and mixers: the gated delta rule (Gated DeltaNet, letter ``G``)
and its channel-wise-decay form (Kimi Delta Attention, letter ``K``).

Operators (``delta_rule``, ``chunk_delta``) are plain functions over ``[b, t, heads, dim]``
tensors; each has a naive token-by-token reference, a recurrent step form for decoding and a
chunked form for training. Mixers (``gdn``, ``kda``) register their layout letters on import.
"""
