"""Decode cache shared by every mixer.

One ``InferenceCache`` per generation; each mixer keeps its own state in the ``LayerState``
that ``cache.layer(layer_number)`` returns: softmax/MLA/DSA keep keys and values (or their
compressed latents) on a time axis through ``append_time``/``keep_last``, linear mixers keep
their conv window and recurrent state as plain items. The model advances ``seen`` after every
forward.

Prompts of different lengths share one batch by **left padding**: row ``i`` starts with
``pad[i]`` padding slots, so every row's newest token sits at the same time index and one
decode step advances all rows together. Time index ``t`` of row ``i`` is position
``t - pad[i]``. Padding never reaches a real token:

- softmax mixers (A, S, M, D, I) mask padded keys (``attention_mask``; a padded query sees
  only itself, so no row of the softmax is empty);
- linear mixers (G, K, L) zero their inputs at padded slots (``zero_pads``): from a zero state,
  zero keys/values leave the state zero and the short conv reads zeros, exactly as if the row
  started at its first real token (transformers' Qwen3-Next masks its linear layers the same way).

States stay on the mixer's TP shard (its heads), so a TP model decodes without gathers.
"""
from __future__ import annotations

import torch

from megamoe.layers.ops.attention.core import causal_mask


class LayerState(dict):
    """One mixer's decode state. Fixed-size states are plain items ("conv", "recurrent");
    time-axis tensors [b, T, ...] grow through ``append_time`` (contiguous here; the paged
    cache keeps them in blocks)."""

    def append_time(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Append ``x`` [b, t, ...] along time; return everything kept so far [b, T, ...]."""
        if name in self:
            x = torch.cat([self[name], x], dim=1)
        self[name] = x
        return x

    def attend_kv(self, cache: "InferenceCache", q, k, v, core, window: int = 0) -> torch.Tensor:
        """Decoding softmax attention: keys and values k, v [b, t, hk, d] appended as "k", "v",
        then q [b, t, hq, d] attends over every key kept (``core``, padded keys masked; ``window``:
        a sliding window) -> [b, t, hq, dv]."""
        k, v = self.append_time("k", k), self.append_time("v", v)
        mask = cache.attention_mask(q.size(1), k.size(1), window, q.device)
        return core(q, k, v) if mask is None else core(q, k, v, mask=mask.unsqueeze(1))

    def attend_latent(self, cache: "InferenceCache", q_lat, q_rope, c, k_rope, core, scale: float) -> torch.Tensor:
        """Decoding MLA attention in the absorbed form: latents c [b, t, r] and k_rope [b, t, dr]
        appended as "c", "k_rope", then ``core(q_lat, q_rope, c, k_rope, scale, mask)`` over all
        of them -> [b, t, H, r]."""
        c, k_rope = self.append_time("c", c), self.append_time("k_rope", k_rope)
        mask = cache.attention_mask(q_lat.size(1), c.size(1), device=q_lat.device)
        if mask is None:
            mask = causal_mask(q_lat.size(1), c.size(1), device=q_lat.device)
        return core(q_lat, q_rope, c, k_rope, scale, mask)

    def attend_selected(self, cache: "InferenceCache", q_lat, q_rope, c, k_rope, idx, core,
                        scale: float) -> torch.Tensor:
        """Decoding DSA attention: latents c [b, t, r] and k_rope [b, t, dr] appended as "c", "k_rope",
        then ``core(q_lat, q_rope, c, k_rope, idx, scale)`` over the keys idx [b, t, K] selects
        (time indices of the cache; -1 = none) -> [b, t, H, r]."""
        c, k_rope, idx = self.select_keys(cache, {"c": c, "k_rope": k_rope}, idx)  # a quantised cache: only idx's
        return core(q_lat, q_rope, c, k_rope, idx, scale)

    def attend_tokens(self, cache: "InferenceCache", q, k, v, tok, core, scale: float) -> torch.Tensor:
        """Decoding block-sparse attention: keys and values k, v [b, t, G, d] appended as "k", "v",
        then ``core(q, k, v, tok, scale)`` over the keys tok [b, t, G, N] keeps (time indices; -1 =
        none) -> [b, t, H, d]."""
        k, v, tok = self.select_keys(cache, {"k": k, "v": v}, tok, grouped=True)  # a quantised cache: only tok's
        return core(q, k, v, tok, scale)

    def append_prefill(self, cp, local: dict[str, torch.Tensor],
                       gathered: dict[str, torch.Tensor] | None = None) -> None:
        """A prefill under context parallelism (``cp``, a ``ContextShard``): ``local`` holds this rank's
        chunks of each time-axis tensor [b, s_local, ...]. This cache keeps the whole sequence on
        every rank: the all-gathered ``gathered`` (or ``local`` gathered here) appended along time
        (a ``ContextSplitCache`` keeps only ``local``: ``megamoe.layers.cache.split``)."""
        self.extend({name: (cp.gather(x) if gathered is None else gathered[name]).detach()  # nothing read back
                     for name, x in local.items()})

    def extend(self, new: dict[str, torch.Tensor]) -> None:
        """Append each of ``new`` (name -> [b, t, ...]) along time, reading nothing back."""
        for name, x in new.items():
            self.append_time(name, x)

    def time_tiles(self, cache: "InferenceCache", names: tuple[str, ...], t_q: int, window: int = 0):
        """The kept time axis of ``names`` (this forward's t_q steps already appended), a tile at a
        time: yields (each name's steps [b, n, ...], mask [1|b, t_q, n] bool, True = the query may
        attend the key). Here one tile of everything kept; a quantised paged cache dequantises a
        bounded tile at a time, and a reserved one's tiles run on past the kept steps (masked
        there: ``PagedCache.tile_span``)."""
        kept = [self[name] for name in names]
        end = cache.seen + t_q
        yield (*kept, cache.key_mask(t_q, end - kept[0].size(1), end, window, kept[0].device))

    def position_tiles(self, cache: "InferenceCache", names: tuple[str, ...], t_q: int, multiple: int = 1):
        """The kept steps of ``names`` (this forward's t_q appended) by each row's own positions: row
        r's position p at index p (its left padding dropped, zeros after its last), seen + t_q
        positions in all, a tile at a time: yields each name's [b, n, ...], n a multiple of
        ``multiple`` (but in the last tile). Here one tile; a reserved quantised paged cache's tiles
        run on past them (zeros: callers cut them off)."""
        yield tuple(row_aligned(self[name], cache.pad) for name in names)

    def select_keys(self, cache: "InferenceCache", new: dict[str, torch.Tensor], idx: torch.Tensor,
                    grouped: bool = False) -> tuple[torch.Tensor, ...]:
        """Append ``new`` (name -> [b, s, ...]), then what a sparse attention reads for the chosen
        kept steps idx [b, s, K] (-1: none; ``grouped``: [b, s, G, K], key head g's steps of
        [b, T, G, d] keys): (each name's keys [b, T', ...], idx') with keys[r, idx'] == kept[r, idx]
        wherever idx >= 0. Here everything kept and idx itself; a quantised paged cache
        dequantises only the chosen steps (T' = s K)."""
        return (*(self.append_time(name, x) for name, x in new.items()), idx)

    def append_entries(self, name: str, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each row's ``valid`` [b, n] entries of ``x`` [b, n, ...] after the row's own (an
        axis of its own, not time: DeepSeek-V4's compressed entries complete at different steps in
        rows of different padding). Returns everything kept [b, N, ...], row r's first counts[r]
        slots filled, zeros after, and the counts [b]."""
        out, counts = append_right(self.get(name), self.get(name + "#count"), x, valid)
        self[name], self[name + "#count"] = out, counts
        return out, counts

    def extend_entries(self, name: str, x: torch.Tensor, valid: torch.Tensor) -> None:
        """``append_entries``, reading nothing back."""
        self.append_entries(name, x, valid)

    def entry_tiles(self, names: tuple[str, ...]):
        """The kept entries of ``names`` (``append_entries``' axis, right-padded with zeros) a tile at
        a time: yields (the tile's first slot, each name's [b, n, ...]). Here one tile of all."""
        yield (0, *(self[name] for name in names))

    def attend_entries(self, name: str, whole, tiled):
        """An attention over every kept entry of ``name``: ``whole(entries [b, N, ...])`` here; a
        quantised paged cache calls ``tiled(entry_tiles((name,)))`` instead."""
        return whole(self[name])

    def select_entries(self, name: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``select_keys`` on the entries' axis: the entries a sparse attention reads for idx [b, s, K]
        (-1: none) -> (entries [b, N', ...], idx') with entries[r, idx'] == kept[r, idx]."""
        return self[name], idx

    def keep_last(self, names: tuple[str, ...], keep: int) -> None:
        """Keep only the last ``keep`` time steps of ``names`` (sliding-window layers)."""
        for name in names:
            n = self[name].size(1)
            if n > keep:
                self[name] = self[name][:, n - keep:]

    def select_rows(self, index: torch.Tensor) -> None:
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.index_select(0, index)

    def tensors(self):
        """Every tensor this state holds (memory accounting)."""
        return [v for v in self.values() if isinstance(v, torch.Tensor)]


class InferenceCache:
    """``pad``: [b] left-padding slots per row (None: every row starts at time 0)."""

    def __init__(self, batch_size: int, pad: torch.Tensor | None = None):
        self.batch_size = batch_size
        self.seen = 0  # time steps already processed (padding slots included)
        self.pad = None if pad is None or not bool((pad > 0).any()) else pad.long()
        self.max_pad = 0 if self.pad is None else int(self.pad.max())  # time steps past it are all real
        self._layers: dict = {}
        self._mask = None  # (key, mask) of the last attention_mask

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, over all layers (memory accounting)."""
        return [t for state in self._layers.values() for t in state.tensors()]

    def layer(self, layer_number) -> LayerState:
        return self._layers.setdefault(layer_number, self.new_state(layer_number))

    def new_state(self, layer_number) -> LayerState:
        return LayerState()

    def advance(self, n: int) -> None:
        self.seen += n
        self._mask = None  # a mask serves one forward's layers; none left over keeps a compiled step's guards stable

    def positions(self, n: int, device=None) -> torch.Tensor:
        """[b, n] positions of the next n time steps (padding slots at position 0)."""
        pos = torch.arange(self.seen, self.seen + n, device=device).unsqueeze(0).expand(self.batch_size, -1)
        if self.pad is None:
            return pos
        return (pos - self.pad.to(pos.device)[:, None]).clamp(min=0)

    def valid(self, n: int, device=None) -> torch.Tensor | None:
        """[b, n] bool, True at the real tokens of the next n time steps (None: no padding among
        them, e.g. every decode step after the prompt)."""
        if self.pad is None or self.seen >= self.max_pad:
            return None
        t = torch.arange(self.seen, self.seen + n, device=device)
        return t[None, :] >= self.pad.to(t.device)[:, None]

    def attention_mask(self, t_q: int, t_k: int, window: int = 0, device=None) -> torch.Tensor | None:
        """[b, t_q, t_k] bool (True = may attend) for the next t_q queries over the last t_k keys
        (``window`` > 0: at most that many keys, itself included). None without padding: the
        caller's plain causal path applies."""
        if self.pad is None:
            return None
        key = (self.seen, t_q, t_k, window, device)  # every softmax layer of a step asks alike
        if self._mask is None or self._mask[0] != key:
            self._mask = key, self._padded_mask(t_q, t_k, window, device)
        return self._mask[1]

    def key_mask(self, t_q: int, k_start: int, k_end: int, window: int = 0, device=None) -> torch.Tensor:
        """[1|b, t_q, n] bool (True = may attend) for the next t_q queries over the keys at time
        steps [k_start, k_end) of the common axis: causal, ``window``, padded keys masked (a
        padded query sees itself) -- ``attention_mask``'s (or the causal mask's) columns for them."""
        total = self.seen + t_q
        q = torch.arange(total - t_q, total, device=device)[:, None]
        k = torch.arange(k_start, k_end, device=device)[None, :]
        allowed = k <= q
        if window > 0:
            allowed = allowed & (k > q - window)
        if self.pad is None:
            return allowed[None]
        real = k[None] >= self.pad.to(k.device)[:, None, None]
        return allowed[None] & (real | (k == q)[None])

    def _padded_mask(self, t_q: int, t_k: int, window: int, device) -> torch.Tensor:
        total = self.seen + t_q
        return self.key_mask(t_q, total - t_k, total, window, device)

    def pad_or_zeros(self) -> torch.Tensor:
        """pad [b], zeros without padding."""
        return self.pad if self.pad is not None else torch.zeros(self.batch_size, dtype=torch.long)

    def snapshot(self):
        """What ``restore`` needs to undo the forwards after this call (speculative decoding's
        rejected drafts). Mixers replace their state tensors and never write into them, so shallow
        copies of the states are enough."""
        return self.seen, {n: LayerState(state) for n, state in self._layers.items()}

    def restore(self, snapshot) -> None:
        """Back to ``snapshot`` (rows must not have been selected since)."""
        self.seen, layers = snapshot
        self._layers = {n: LayerState(state) for n, state in layers.items()}
        self._mask = None

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep/reorder rows (beam search, dropping finished rows) in every state."""
        for state in self._layers.values():
            state.select_rows(index)
        if self.pad is not None:
            self.pad = self.pad.index_select(0, index.to(self.pad.device))
            self.max_pad = int(self.pad.max()) if self.pad.numel() else 0
        self._mask = None
        self.batch_size = int(index.numel())


def zero_pads(x: torch.Tensor, cache: InferenceCache | None) -> torch.Tensor:
    """x [b, s, ...] with the padding slots of these s time steps zeroed (linear mixers' inputs)."""
    valid = None if cache is None else cache.valid(x.size(1), x.device)
    if valid is None:
        return x
    return x * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)


def row_aligned(x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    """x [b, T, ...] on the common time axis -> row r's position p at index p (its ``pad`` [b] left
    padding slots dropped, zeros after its last step)."""
    if pad is None:
        return x
    total = x.size(1)
    j = torch.arange(total, device=x.device)[None, :] + pad.to(x.device)[:, None]  # [b, T] time index
    lead = (*j.shape, *([1] * (x.dim() - 2)))
    return torch.where((j < total).view(lead), x.gather(1, j.clamp(max=total - 1).view(lead).expand_as(x)), 0)


def append_right(old: torch.Tensor | None, counts: torch.Tensor | None, x: torch.Tensor, valid: torch.Tensor,
                 fill: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded per-row lists: ``old`` [b, N0, ...] holding counts[r] items in row r (None:
    empty), the ``valid`` [b, n] items of ``x`` [b, n, ...] appended after them -> ([b, N, ...]
    with ``fill`` in unused slots, the new counts [b])."""
    b = x.size(0)
    counts = torch.zeros(b, dtype=torch.long, device=x.device) if counts is None else counts
    total = counts + valid.sum(1)
    width = int(total.max()) if b else 0
    out = torch.full((b, width, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    if old is not None:
        out[:, :old.size(1)] = old[:, :width]
    slot = counts[:, None] + valid.long().cumsum(1) - 1
    rows = torch.arange(b, device=x.device)[:, None].expand_as(slot)
    out[rows[valid], slot[valid]] = x[valid]
    return out, total


def append_kv(state: LayerState, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append new keys/values [b, t, h, d] along time; return all of them."""
    return state.append_time("k", k), state.append_time("v", v)


def append_time(state: LayerState, name: str, x: torch.Tensor) -> torch.Tensor:
    """Append ``x`` [b, t, ...] to ``state[name]`` along time (dim 1); return everything so far."""
    return state.append_time(name, x)


def trim_kv(state: LayerState, keep: int) -> None:
    """Keep only the last ``keep`` cached keys/values (sliding-window layers)."""
    state.keep_last(("k", "v"), keep)
