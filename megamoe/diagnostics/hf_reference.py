"""transformers' model of an HF folder built on the meta device, each piece (the embedding, one
decoder layer, the final norm, the output layer) materialised from the checkpoint's safetensors
only while it runs: the reference of the streamed comparison (``megamoe.diagnostics.streamed``).

transformers' own forward runs the model (its masks, rotary tables, hyper-connection streams and
anything it passes between layers); hooks on each decoder layer load it just before it runs and
free it right after, and first let the comparison run it on megamoe's input as well. Weights are
read by transformers' own loading (``convert_and_load_state_dict_in_model`` with the model's
conversion mapping: per-expert tensors stacked, renamed keys) from the checkpoint tensors of that
piece only, in fp32. An FP8 checkpoint is read dequantised (megamoe's reader), the model built
without its quantization_config: transformers' maths on the dequantised weights.
"""
from __future__ import annotations

import contextlib

import torch

from megamoe.convert.api import HFWeights
from megamoe.core.errors import CheckpointError, ConfigError
from megamoe.diagnostics.streamed import to_meta


class _Handoff(Exception):
    """Raised after a pipeline stage's last layer: the rest of the model belongs to later stages."""

    def __init__(self, out):
        self.out = out


def hidden_of(out) -> torch.Tensor:
    """A decoder layer's output (a tensor, or a tuple whose first item is the hidden states)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def routes_of(out) -> torch.Tensor | None:
    """A router's output tuple -> its top-k expert ids [T, k], sorted per token (None: not a router)."""
    if not isinstance(out, (tuple, list)):
        return None
    ids = [t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2]
    return ids[-1].sort(dim=-1).values if ids else None


def build_meta(weights: HFWeights):
    """transformers' model of the folder, parameters on the meta device, its non-persistent
    buffers (rotary frequencies) computed on the CPU as ``from_pretrained`` computes them."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(weights.path))
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # read dequantised (HFWeights' reader)
    arch = (weights.ck.config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        model = (cls._from_config(config, dtype=torch.float32) if hasattr(cls, "_from_config")
                 else transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    owners = {}
    for name, buf in list(model.named_non_persistent_buffers()):
        path, _, attr = name.rpartition(".")
        owners[path] = owner = model.get_submodule(path)
        owner._buffers[attr] = torch.empty_like(buf, device="cpu")
    for owner in owners.values():
        model._init_weights(owner)
    out = model.get_output_embeddings()
    if out is not None and out.weight is model.get_input_embeddings().weight:  # tied: one piece each
        out.weight = torch.nn.Parameter(torch.empty_like(out.weight, device="meta"), requires_grad=False)
    return model.eval()


def decoder_layers(model, num_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The text decoder's layer list (the first ModuleList of ``num_layers`` named '...layers' that
    is not in a vision tower)."""
    for name, m in model.named_modules():
        if (isinstance(m, torch.nn.ModuleList) and name.endswith("layers") and len(m) == num_layers
                and "vision" not in name and "visual" not in name):
            return name, m
    raise ConfigError(f"{type(model).__name__}: no decoder layer list of {num_layers} layers found")


class MetaHF:
    """The reference: ``drive(ids, visit, layers, last, chain_in)`` runs transformers' forward with
    ``layers`` (global indices, one pipeline stage's) materialised one at a time."""

    def __init__(self, weights: HFWeights):
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.src = weights.ck
        self.model = build_meta(weights)
        self.prefix, self.layers = decoder_layers(self.model, weights.cfg.parsed_layout().num_layers)
        self.mapping = get_model_conversion_mapping(self.model)
        self.pieces = self._pieces()
        self.keys = self._keys_by_piece()
        self.routes: list[torch.Tensor] = []
        for layer in self.layers:
            for name, m in layer.named_modules():
                if name.endswith(("gate", "router")):
                    m.register_forward_hook(lambda mod, a, out: self._route(out))

    def _route(self, out) -> None:
        r = routes_of(out)
        if r is not None:
            self.routes.append(r)

    def _pieces(self) -> dict[str, torch.nn.Module]:
        """Module path -> module, for every decoder layer and every module outside them that
        holds parameters or persistent buffers of its own."""
        pieces = {f"{self.prefix}.{i}": layer for i, layer in enumerate(self.layers)}
        for name, m in self.model.named_modules():
            own = list(m._parameters) + [k for k in m._buffers if k not in m._non_persistent_buffers_set]
            if own and not name.startswith(self.prefix + "."):
                pieces[name] = m
        return pieces

    def _keys_by_piece(self) -> dict[str, list[str]]:
        """The checkpoint tensors each piece is made of, by the names transformers loads them to."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        renamings = [t for t in self.mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in self.mapping if isinstance(t, WeightConverter)]
        meta = self.model.state_dict()
        order = sorted(self.pieces, key=len, reverse=True)  # the longest prefix owns a key
        keys: dict[str, list[str]] = {name: [] for name in self.pieces}
        for key in sorted(self.src.names):
            target, _ = rename_source_key(key, renamings, converters, self.model.base_model_prefix, meta)
            if target not in meta:
                continue  # not part of transformers' model (e.g. multi-token-prediction layers)
            keys[next(p for p in order if target.startswith(p + "."))].append(key)
        out = self.model.get_output_embeddings()
        if out is not None:
            head = next(n for n, m in self.pieces.items() if m is out)
            embed = next(n for n, m in self.pieces.items() if m is self.model.get_input_embeddings())
            if not keys[head]:  # tied embeddings: the output layer reads the embedding's tensor
                keys[head] = [(k, f"{head}.weight") for k in keys[embed]]
        return keys

    @contextlib.contextmanager
    def loaded(self, name: str):
        """Piece ``name`` read from the checkpoint (fp32) for the block's duration, then freed."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        piece = self.pieces[name]
        state = {(k[1] if isinstance(k, tuple) else k): self.src.tensor(k[0] if isinstance(k, tuple) else k)
                 for k in self.keys[name]}
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            convert_and_load_state_dict_in_model(self.model, state, LoadStateDictConfig(
                dtype=torch.float32, weight_mapping=self.mapping, device_map={"": "cpu"}))
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        del state
        missing = [n for n, p in piece.named_parameters() if p.is_meta]
        if missing:
            raise CheckpointError(f"{self.src.path}: no tensor for transformers' {name}.{missing[0]}")
        try:
            yield piece
        finally:
            to_meta(piece)

    def drive(self, ids: torch.Tensor, visit, layers: list[int], last: bool, chain_in=None) -> None:
        """transformers' forward of ``ids`` [b, s] through ``layers``: ``visit.before(i, run)``,
        ``visit.after(i, out, routes)`` around each, then ``visit.final(normed, logits)`` (``last``)
        or ``visit.handoff(out)``. ``chain_in``: a later stage's input (the previous stage's
        output), the layers before it skipped."""
        with contextlib.ExitStack() as stack, torch.no_grad():  # a graph would keep every layer's weights
            captured = {}
            decoder = self.model.get_decoder()
            stack.callback(decoder.register_forward_hook(
                lambda m, a, out: captured.__setitem__("normed", out[0])).remove)
            for name, piece in self.pieces.items():
                if piece in self.layers:
                    continue
                if chain_in is not None and piece is self.model.get_input_embeddings():
                    self._stub(stack, piece, lambda x: torch.zeros(*x.shape, self.model.config.hidden_size))
                else:
                    stack.enter_context(self._streamed(piece, name))
            for i, layer in enumerate(self.layers):
                if i < layers[0]:
                    self._stub(stack, layer, lambda *a, **k: chain_in)
                elif i <= layers[-1]:
                    stack.enter_context(self._layer_hooks(i, layer, visit, stop=not last and i == layers[-1]))
            try:
                logits = self.model(input_ids=ids, use_cache=False).logits
            except _Handoff as h:
                visit.handoff(h.out)
                return
            visit.final(captured["normed"], logits)

    @staticmethod
    def _stub(stack, module, forward) -> None:
        module.forward = forward
        stack.callback(lambda: module.__dict__.pop("forward", None))

    @contextlib.contextmanager
    def _streamed(self, piece, name: str):
        """An outer piece (embedding, norm, output layer) loaded before its forward, freed after."""
        held = []

        def pre(mod, args):
            held.append(self.loaded(name))
            held[-1].__enter__()

        def post(mod, args, out):
            held.pop().__exit__(None, None, None)

        with hooked(piece, pre, post, held):
            yield

    @contextlib.contextmanager
    def _layer_hooks(self, i: int, layer, visit, stop: bool):
        """Layer i: before its own forward the comparison runs it on megamoe's input (``run``),
        after it the own output is reported; loaded once for both, freed after."""
        held = []
        name = f"{self.prefix}.{i}"

        def load():
            if not held:
                held.append(self.loaded(name))
                held[-1].__enter__()

        def run(x):
            load()
            args, kwargs = self._args
            self.routes.clear()
            if args:
                out = layer.forward(x.float(), *args[1:], **kwargs)
            else:
                out = layer.forward(**{**kwargs, "hidden_states": x.float()})
            return hidden_of(out), (self.routes[-1] if self.routes else None)

        def pre(mod, args, kwargs):
            self._args = (args, kwargs)
            visit.before(i, run)
            load()
            self.routes.clear()

        def post(mod, args, kwargs, out):
            visit.after(i, hidden_of(out), self.routes[-1] if self.routes else None)
            held.pop().__exit__(None, None, None)
            if stop:
                raise _Handoff(hidden_of(out))

        with hooked(layer, pre, post, held, with_kwargs=True):
            yield


@contextlib.contextmanager
def hooked(module, pre, post, held: list, with_kwargs: bool = False):
    """``pre``/``post`` as ``module``'s forward hooks for the block; afterwards the hooks are
    removed and whatever is still loaded (``held``: entered ``MetaHF.loaded`` blocks) is freed."""
    handles = [module.register_forward_pre_hook(pre, with_kwargs=with_kwargs),
               module.register_forward_hook(post, with_kwargs=with_kwargs)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while held:
            held.pop().__exit__(None, None, None)
