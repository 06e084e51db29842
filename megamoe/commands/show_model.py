"""Print a recipe's layout, per-layer kinds and parameter budget without allocating weights.

    megamoe-show-model --config tiny_dense
    megamoe-show-model --config dense_105b model.layout='(Ad)*80'
    megamoe-show-model --config tiny_dense --step    # also build it and run one fwd+bwd
"""
import time

import torch

from megamoe.commands.cli import number_in, recipe_parser, run_main
from megamoe.core.config import validate_model_parallel
from megamoe.planning.plan import describe
from megamoe.recipe import load_recipe


def smoke_step(model_cfg, seq_len: int, batch: int) -> None:
    """Build the model for real (single process), run forward+backward on random tokens."""
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.weights import initialize

    t = time.time()
    model = LanguageModel(model_cfg)
    initialize(model, model.groups, seed=0)
    ids = torch.randint(0, model_cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=shift_labels(ids))
    loss.backward()
    grad_norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    print(f"step: batch {batch}x{seq_len}, loss {loss.item():.4f} (ln V = {torch.log(torch.tensor(float(model_cfg.vocab_size))):.4f}), "
          f"grad norm {grad_norm:.4f}, {time.time() - t:.2f}s")


def main(argv: list[str] | None = None) -> None:
    p = recipe_parser(__doc__.strip().splitlines()[0])
    p.add_argument("--step", action="store_true", help="build the model and run one forward+backward")
    p.add_argument("--seq-len", type=number_in(int, 1), default=64)
    p.add_argument("--batch", type=number_in(int, 1), default=2)
    args = p.parse_args(argv)
    recipe = load_recipe(args.config, args.overrides)
    validate_model_parallel(recipe.model, recipe.parallel)
    print(describe(recipe.model))
    if args.step:
        smoke_step(recipe.model, args.seq_len, args.batch)


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
