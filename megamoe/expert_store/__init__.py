"""Tiered expert storage: frozen routed experts stay in a store and come in when routed to.

    store = open_expert_store(chunks, groups, path)     # the tiered layers of a rank's chunks
    save_converted(model, out_dir)                       # a store (converted checkpoint) of a model

See ``megamoe.expert_store.store`` (the store and its budget), ``megamoe.expert_store.mapped`` (on a CPU:
kernels on views of the memory-mapped store, the pages mapped in bounded), ``megamoe.expert_store.slot_cache``
(otherwise: the LRU cache of copied experts), ``megamoe.expert_store.prefetch`` (the background thread
both use), ``megamoe.expert_store.source`` (bounded reads of expert slices from a converted
checkpoint), ``megamoe.expert_store.hf`` (the same from the HF directory a model was imported from)
and docs/memory.md.
"""
from megamoe.expert_store.store import ExpertStore, open_expert_store, stored_layers
from megamoe.expert_store.write import save_converted

__all__ = ["ExpertStore", "open_expert_store", "save_converted", "stored_layers"]
