"""Layer-streamed comparison: megamoe against a reference one decoder layer at a time, for models
that do not fit one host.

Both sides are built on the meta device; a piece (the embedding, one decoder layer, the head) is
materialised from the HF checkpoint only while it runs and goes back to meta right after, so a
process holds one layer of each side at most (never both at once) plus the activations:

    megamoe (candidate)       StreamedModel: this rank's pipeline stage and shards, any backend and
                              dtype, filled by ``HFWeights.fill`` (the converter's own reading)
    reference                 ``megamoe.diagnostics.hf_reference.MetaHF`` (transformers' model), or a
                              single-process StreamedModel on the ``local`` backend in fp32/fp64
                              (the kernel-precision report)

For every layer i the reference runs twice: on the hidden states megamoe's layer i received
(``local``: that layer's own error) and on its own previous output (``chain``: the error as it
accumulates, what a whole-model comparison sees). Rows: relative error, cosine, routing agreement.

    embed:   h_0 = megamoe.embed(ids)                    g_0 = reference embedding
    layer i: m_i = megamoe_i(h_i)    local_i = ref_i(h_i)    g_{i+1} = ref_i(g_i)
             local row (local_i vs m_i), chain row (g_{i+1} vs m_i); h_{i+1} = m_i
    head:    final norm and logits of each side's own chain

At a parallel layout (torchrun) every rank of a stage runs megamoe's layers with its shards; the
reference runs on the stage's first rank (``reports``), which prints. Pipeline stages pass both
chains on (``comm``); only a stage's own layers are ever read.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megamoe.convert.api import HFWeights, model_tensors
from megamoe.diagnostics.precision import LayerRow, layer_row, table
from megamoe.layers.spec import ForwardInfo
from megamoe.model.build import build_model, stage_cut
from megamoe.parallel.comm import all_gather_tensor
from megamoe.parallel.groups import ParallelGroups


def to_meta(module: torch.nn.Module) -> None:
    """Drop ``module``'s parameters and persistent buffers back to the meta device (their memory
    is freed; non-persistent buffers, computed at build, stay)."""
    to_device(module, "meta")


def to_device(module: torch.nn.Module, device) -> None:
    """``module``'s parameters and persistent buffers replaced by uninitialised ones on ``device``.
    Unlike ``Module.to_empty`` (which makes new parameters between meta and a real device) each
    parameter keeps its attributes: how it is sharded, which the filling reads."""
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                m._parameters[k].__dict__.update(p.__dict__)
        for k, b in m._buffers.items():
            if b is not None and k not in m._non_persistent_buffers_set:
                m._buffers[k] = torch.empty_like(b, device=device)


def sorted_routes(router_output) -> torch.Tensor:
    """A megamoe router's choice -> [T, k] expert ids sorted per token."""
    return router_output.idx.sort(dim=-1).values


class StreamedModel:
    """megamoe's model of ``weights`` (an opened HF folder), this rank's stage ``(stage, stages)``
    and shards, built on the meta device. ``backend``/``fp8``: the roles its layers run (None:
    the config's); ``dtype``: the dtype each piece runs in (weights cast after reading, inputs
    cast on entry)."""

    def __init__(self, weights: HFWeights, groups: ParallelGroups | None = None, stage: tuple[int, int] = (0, 1),
                 *, backend: str | None = None, dtype: torch.dtype = torch.float32, fp8: str | None = None):
        cfg = copy.deepcopy(weights.cfg)
        if backend is not None:
            cfg.backend = backend
        self.weights, self.groups, self.dtype = weights, groups or ParallelGroups(), dtype
        self.model = build_model(cfg, self.groups, device="meta", fp8=fp8, **stage_cut(cfg, stage))
        self.model.eval()
        self.layout = cfg.parsed_layout()
        self.layer_ids = [int(i) for i in self.model.layers]
        self.info = None

    @contextlib.contextmanager
    def loaded(self, *modules: torch.nn.Module):
        """``modules`` materialised from the checkpoint (this rank's shards, cast to ``dtype``) for
        the block's duration, then back on meta."""
        names = {id(m): n for n, m in self.model.named_modules()}
        for m in modules:
            to_device(m, "cpu")
        prefixes = tuple(names[id(m)] + "." for m in modules)
        self.weights.fill({n: t for n, t in model_tensors(self.model).items() if n.startswith(prefixes)}, self.groups)
        for m in modules:
            m.to(self.dtype)
        try:
            yield
        finally:
            for m in modules:
                to_meta(m)

    def start(self, ids: torch.Tensor, embed: bool = True) -> torch.Tensor | None:
        """Set up a forward of ``ids`` [b, s]; with ``embed`` the first stage returns the residual
        stream after the embedding [b, s, (n,) h] (otherwise None: the stream comes from elsewhere)."""
        m = self.model
        positions = torch.arange(ids.size(1)).unsqueeze(0).expand(ids.size(0), -1)
        self.info = ForwardInfo(positions=positions, token_ids=ids)
        if not (embed and m.pre_process):
            return None
        with torch.no_grad(), self.loaded(m.embedding):
            return m.block.enter_stream(m.embed(ids), m.config).to(self.dtype)

    def run_layer(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i`` on ``x`` (materialised for it): (its output, its router's sorted top-k
        [T, k] or None)."""
        layer = self.model.layers[str(i)]
        routes = []
        router = getattr(getattr(layer, "mlp", None), "router", None)
        hook = router.register_forward_hook(lambda mod, a, out: routes.append(sorted_routes(out))) if router else None
        try:
            with torch.no_grad(), self.loaded(layer), self.model.ctx.backend.stage_context(self.groups):
                out = layer(x.to(self.dtype), self.info)
        finally:
            if hook is not None:
                hook.remove()
        return out, (self.all_routes(routes[-1], x) if routes else None)

    def all_routes(self, routes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The whole batch's routes [b*s, k]: at TP > 1 each rank routes its share of the sequence
        (``MoELayer`` splits it), so the shares are gathered back in sequence order."""
        b, s = x.shape[:2]
        if routes.size(0) == b * s:
            return routes
        return all_gather_tensor(routes.view(b, -1, routes.size(-1)), 1, self.groups.tp).reshape(b * s, -1)

    def finish(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's head on its last layer's stream: (final-norm output [b, s, h], logits
        [b, s, V] gathered over TP)."""
        m = self.model
        pieces = [p for p in (m.stream_head, m.final_norm, m.output_layer) if p is not None]
        if m.config.tie_embeddings:
            pieces.append(m.embedding)
        with torch.no_grad(), self.loaded(*pieces):
            normed = m.final_norm(m.leave_stream(x))
            return normed, m.gather_logits(m.head(m.leave_stream(x)))

    # ---- as the reference (the kernel-precision report) -------------------------------------

    def drive(self, ids: torch.Tensor, visit: "Visit", layers: list[int], last: bool, chain_in=None) -> None:
        """Run this model as the reference (as ``MetaHF.drive``): ``visit.before(i, run)`` before
        each of ``layers`` (``run(x)``: the layer on any input), ``visit.after(i, own output,
        routes)``, then ``visit.final(normed, logits)`` (``last``) or ``visit.handoff(stream)``."""
        x = self.start(ids, embed=chain_in is None)
        x = x if chain_in is None else chain_in.to(self.dtype)
        for i in layers:
            visit.before(i, lambda h, i=i: self.run_layer(i, h))
            x, routes = self.run_layer(i, x)
            visit.after(i, x, routes)
        if last:
            visit.final(*self.finish(x))
        else:
            visit.handoff(x)


@dataclass
class StreamReport:
    """``local``: each layer against the reference fed megamoe's input; ``chain``: against the
    reference's own previous output. ``final``: (rel error, cosine) of the final-norm output and
    the logits' max abs difference (None off the last stage)."""

    local: list[LayerRow] = field(default_factory=list)
    chain: list[LayerRow] = field(default_factory=list)
    final: tuple[float, float, float] | None = None

    def text(self, name: str, tol: float) -> str:
        """The printed report: both tables (``name`` (own input) and ``name`` (chained)), then the
        head's line on the last stage."""
        out = [table(f"{name} (own input)", self.local, tol), table(f"{name} (chained)", self.chain, tol)]
        if self.final is not None:
            rel, cos, logits = self.final
            out.append(f"{name}: final norm rel_err {rel:.3e} cosine {cos:.6f}; logits max abs diff {logits:.3e}")
        return "\n".join(out)


class Visit:
    """What the reference calls while it runs (the reporting rank): each layer's rows are computed
    here, megamoe's layer having run first (``candidate.step``) so only one side's layer is ever
    materialised at a time."""

    def __init__(self, candidate: "Candidate", report: StreamReport):
        self.candidate, self.report, self.pending = candidate, report, {}
        self.handed = None

    def before(self, i: int, run) -> None:
        h, m, routes = self.candidate.step(i)
        r, r_routes = run(h)
        kind = self.candidate.model.layout.layers[i]
        self.report.local.append(layer_row(i, kind, r, m, r_routes, routes))
        self.pending[i] = (m, routes)

    def after(self, i: int, out: torch.Tensor, routes) -> None:
        m, m_routes = self.pending.pop(i)
        self.report.chain.append(layer_row(i, self.candidate.model.layout.layers[i], out, m, routes, m_routes))

    def final(self, normed: torch.Tensor, logits: torch.Tensor) -> None:
        c_normed, c_logits = self.candidate.head()
        row = layer_row(-1, self.candidate.model.layout.layers[-1], normed, c_normed)
        self.report.final = (row.rel_err, row.cosine, (logits.double() - c_logits.double()).abs().max().item())

    def handoff(self, chain_out) -> None:
        self.handed = chain_out


class Candidate:
    """megamoe's side stepped layer by layer on its own chain; between pipeline stages its stream
    goes from each rank to the same position of the next stage (as ``StageForward`` sends)."""

    def __init__(self, model: StreamedModel, ids: torch.Tensor):
        self.model, self.ids = model, ids
        self.x = model.start(ids)
        self.pp = model.groups.pp
        self.stages = dist.get_process_group_ranks(self.pp) if model.groups.size("pp") > 1 else None

    def step(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer i on the stream so far: (its input, its output, its routes)."""
        if self.x is None:  # a later stage's first layer: the previous stage's stream
            self.x = recv_tensor(self.stages[self.model.groups.rank("pp") - 1], self.pp)
        h = self.x
        self.x, routes = self.model.run_layer(i, h)
        return h, self.x, routes

    def head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.finish(self.x)

    def handoff(self) -> None:
        """A stage that is not the last sends its stream on."""
        send_tensor(self.x, self.stages[self.model.groups.rank("pp") + 1], self.pp)


def compare_streamed(candidate: StreamedModel, reference, ids: torch.Tensor) -> StreamReport | None:
    """megamoe (``candidate``, this rank's stage) against ``reference`` (a ``MetaHF`` or a
    single-process ``StreamedModel``; only used on the reporting rank) on ``ids`` [b, s]. Every
    rank calls it; the reporting rank of each stage gets its layers' report, the others None."""
    c = Candidate(candidate, ids)
    groups, last = candidate.groups, candidate.model.post_process
    if not reports(groups):
        for i in candidate.layer_ids:
            c.step(i)
        c.head() if last else c.handoff()
        return None
    report = StreamReport()
    visit = Visit(c, report)
    chain_in = None if candidate.model.pre_process else recv_tensor(c.stages[groups.rank("pp") - 1], c.pp)
    reference.drive(ids, visit, candidate.layer_ids, last, chain_in)
    if not last:  # the reference's chain first, then megamoe's stream (the order the next stage reads)
        send_tensor(visit.handed, c.stages[groups.rank("pp") + 1], c.pp)
        c.handoff()
    return report


def reports(groups: ParallelGroups) -> bool:
    """Whether this rank runs the reference and reports: its stage's first rank."""
    return all(groups.rank(g) == 0 for g in ("tp", "dp", "cp"))


def send_tensor(x: torch.Tensor, dst: int, group) -> None:
    """A tensor of any shape and floating dtype to ``dst``: its rank count, then its shape and
    dtype, then its values."""
    x = x.contiguous()
    dist.send(torch.tensor([x.dim()]), dst, group=group)
    dist.send(torch.tensor([*x.shape, DTYPE_OF.index(x.dtype)]), dst, group=group)
    dist.send(x, dst, group=group)


def recv_tensor(src: int, group) -> torch.Tensor:
    ndim = torch.zeros(1, dtype=torch.long)
    dist.recv(ndim, src, group=group)
    head = torch.zeros(int(ndim) + 1, dtype=torch.long)
    dist.recv(head, src, group=group)
    x = torch.empty(head[:-1].tolist(), dtype=DTYPE_OF[int(head[-1])])
    dist.recv(x, src, group=group)
    return x


DTYPE_OF = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
