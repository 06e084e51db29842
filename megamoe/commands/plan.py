"""Print the plan of a run without starting it: layout, parameter budget, parallel grid and
per-stage memory per rank.

    megamoe-plan --config moe_1t --world-size 1024 parallel.tp=8 parallel.pp=4 parallel.ep=64
"""
from megamoe.cli import number_in, recipe_parser, run_main
from megamoe.plan import describe, memory_plan
from megamoe.training.entry import load_train_recipe


def main(argv: list[str] | None = None) -> None:
    p = recipe_parser(__doc__.strip().splitlines()[0])
    p.add_argument("--world-size", type=number_in(int, 1), default=1, help="number of ranks (GPUs) of the run")
    args = p.parse_args(argv)
    recipe = load_train_recipe(args.config, args.overrides, validate=False)
    recipe.validate_plan(args.world_size)  # what the trainer would refuse, before printing anything
    print(describe(recipe.model))
    print(memory_plan(recipe.model, recipe.parallel, args.world_size, recipe.train.micro_batch_size,
                      recipe.data.seq_len))


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
