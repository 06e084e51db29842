"""Tiered expert storage against all-resident experts: LoRA steps of a MoE model whose routed
experts are most of its weights, kept on disk (``model.moe.expert_store``) under a budget
of 1/8 of their bytes.

    python tools/bench_tiered.py                         # 8 MoE layers x 32 experts, 6.0 GiB fp32 experts
    python tools/bench_tiered.py --experts 16 --batch 2  # half of it (3.0 GiB)
    python tools/bench_tiered.py --store DIR --batch 2   # an existing store of the same model

The store is a converted megamoe checkpoint (``megamoe.expert_store.save_converted``) written first.
Each run is a fresh process (its RSS is its own): build the model, load the non-expert
weights (the resident run: all of them), add LoRA adapters, one warm-up step, then ``--steps``
timed steps (forward, backward, AdamW on the adapters). Peak memory is the peak RSS over the
timed steps (``VmHWM`` reset after the warm-up: the resident run's load-time transients do not
count; the tiered run's cache fills during them and counts), which includes file pages mapped
into the process: on a CPU the kernels read the routed experts from the mapped store, whose
pages mapped in are bounded by the budget (``--no-map``: positioned reads into cache slots,
mapping nothing, the way a GPU brings experts in).

Both runs also hold what any megamoe process holds before it builds a model (the interpreter,
torch and the imports: ~0.55 GiB, printed as ``base``); the larger the model, the less it
weighs in X (docs/performance.md). The ratio net of it is printed beside X as extra
information.

Both runs' host allocator is glibc with its mmap threshold fixed at ``--heap-mmap-kib``
(``MALLOC_MMAP_THRESHOLD_``, default 1 MiB; 0: glibc's default): blocks of that size or more
are mapped on their own and handed back when freed. glibc's default raises the threshold to
the size of each large block freed (up to 32 MiB), after which a step's freed activations stay
in the heap, a few hundred MiB on both sides (docs/memory.md).

Last line: ``tiered_mem_ratio=X tiered_time_ratio=Y`` (tiered / resident peak RSS and median
step time; targets X <= 0.35, Y <= 1.5). The two runs' losses are printed: they agree to
float rounding.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import matmul_rate  # noqa: E402
from megamoe.diagnostics.memory import peak_rss_mib, reset_peak, rss_mib  # noqa: E402


def model_config(args):
    from megamoe.core.config import AttentionConfig, ModelConfig, MoEConfig

    return ModelConfig(vocab_size=1000, hidden_size=args.hidden, layout="Ae" * args.layers, fusion="off",
                       attention=AttentionConfig(num_heads=8, num_kv_heads=2, head_dim=64),
                       moe=MoEConfig(num_experts=args.experts, top_k=args.top_k, moe_ffn_hidden_size=args.ffn))


def experts_bytes(cfg) -> int:
    m = cfg.moe
    return len(cfg.parsed_layout().layers) * m.num_experts * 3 * cfg.hidden_size * m.moe_ffn_hidden_size * 4


def write_store(args, out, queue) -> None:
    from megamoe.model.language_model import LanguageModel
    from megamoe.expert_store import save_converted
    from megamoe.model.weights import initialize

    cfg = model_config(args)
    model = LanguageModel(cfg)
    initialize(model, model.groups, 0)
    save_converted(model, cfg, out)
    queue.put(None)


def run(args, store: str, budget_mib: float | None, queue) -> None:
    import torch.nn.functional as F

    from megamoe.core.config import ExpertStoreConfig
    from megamoe.lora import LoRAConfig, apply_lora, lora_parameters
    from megamoe.model.language_model import LanguageModel
    from megamoe.expert_store import open_expert_store
    from megamoe.checkpoint.dcp import load_checkpoint

    base = int(rss_mib() * 2 ** 20)  # after the imports, before the model
    cfg = model_config(args)
    cfg.moe.expert_store = ExpertStoreConfig(budget_mib=budget_mib, path=store, prefetch=args.prefetch,
                                             map=args.map)
    model = LanguageModel(cfg)
    load_checkpoint(store, model.groups, [model], load_rng=False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)  # the base's
    apply_lora(model, LoRAConfig(rank=8, alpha=16.0))
    expert_store = open_expert_store([model], model.groups)
    optim = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 1000, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps + 1)]
    losses, times, reset = [], [], False
    for i, ids in enumerate(batches):
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if i == 0:
            reset = reset_peak()  # the timed steps' peak from here
        else:
            times.append(time.perf_counter() - start)
    stats = expert_store.stats() if expert_store is not None else {}
    queue.put({"peak": int(peak_rss_mib() * 2 ** 20), "base": base, "reset": reset, "weights": weights,
               "time": statistics.median(times),
               "losses": losses, "stats": stats})


def in_child(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    out = queue.get(timeout=7200)
    proc.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-fraction", type=float, default=1 / 8, help="budget / the experts' bytes (<= 1/8)")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false", help="no background reads")
    p.add_argument("--no-map", dest="map", action="store_false",
                   help="copy experts into cache slots instead of computing from the mapped store (the GPU's way)")
    p.add_argument("--heap-mmap-kib", type=int, default=1024,
                   help="glibc's mmap threshold in both runs (MALLOC_MMAP_THRESHOLD_), KiB; 0: glibc's default")
    p.add_argument("--dir", help="where the store is written (default: a temporary folder, removed after)")
    p.add_argument("--store", help="an existing store of this model (written by an earlier run): no writing")
    args = p.parse_args()
    cfg = model_config(args)
    e_bytes = experts_bytes(cfg)
    budget = e_bytes * args.budget_fraction / 2 ** 20
    if args.heap_mmap_kib:  # read by glibc when each run's process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.heap_mmap_kib * 1024)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = args.store or os.path.join(tmp, "store")
        if not args.store:
            in_child(write_store, args, store)
        resident = in_child(run, args, store, None)
        tiered = in_child(run, args, store, budget)
    total = resident["weights"]
    print(f"machine: fp32 matmul {matmul_rate():.0f} GFLOP/s on {torch.get_num_threads()} threads (after the run)")
    print(f"model: {total / 2 ** 30:.2f} GiB fp32 weights, routed experts {e_bytes / 2 ** 30:.2f} GiB "
          f"({100 * e_bytes / total:.1f}%), {args.layers} MoE layers x {args.experts} experts top-{args.top_k}; "
          f"LoRA rank 8; batch {args.batch} x {args.seq} tokens")
    heap = f"mmap threshold {args.heap_mmap_kib} KiB" if args.heap_mmap_kib else "glibc's default (dynamic)"
    print(f"host allocator in both runs: {heap}")
    print(f"budget: {budget:.0f} MiB (experts / {e_bytes / 2 ** 20 / budget:.1f}); store counters: {tiered['stats']}")
    print(f"{'run':>9} {'peak RSS GiB':>13} {'base GiB':>9} {'step s':>8}  losses")
    for name, r in (("resident", resident), ("tiered", tiered)):
        print(f"{name:>9} {r['peak'] / 2 ** 30:>13.2f} {r['base'] / 2 ** 30:>9.2f} {r['time']:>8.2f}  "
              f"{[round(x, 6) for x in r['losses']]}")
    if not (resident["reset"] and tiered["reset"]):
        print("note: /proc/self/clear_refs was not writable: peaks include the setup")
    diff = max(abs(a - b) for a, b in zip(resident["losses"], tiered["losses"]))
    print(f"max |loss difference| = {diff:.2e}")
    net = (tiered["peak"] - tiered["base"]) / (resident["peak"] - resident["base"])
    print(f"net of each run's base (extra information): {net:.3f}")
    print(f"tiered_mem_ratio={tiered['peak'] / resident['peak']:.3f} "
          f"tiered_time_ratio={tiered['time'] / resident['time']:.3f}")


if __name__ == "__main__":
    main()
