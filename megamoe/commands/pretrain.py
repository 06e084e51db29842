"""Pretrain a model from a recipe (YAML + key=value overrides), on one or many processes.

    megamoe-pretrain --config tiny_train
    torchrun --nproc-per-node 4 -m megamoe.commands.pretrain --config tiny_train parallel.tp=2 parallel.pp=2
"""
from megamoe.commands.cli import recipe_parser, run_main
from megamoe.recipe import load_train_recipe
from megamoe.training.entry import finish, run_training


def main(argv: list[str] | None = None) -> None:
    args = recipe_parser(__doc__.strip().splitlines()[0]).parse_args(argv)
    finish(run_training(load_train_recipe(args.config, args.overrides)))


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
