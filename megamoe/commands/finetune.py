"""Fine-tune a model from existing weights (a converted HF checkpoint or a training checkpoint).

    megamoe-convert import-hf HF_DIR ckpt/base
    megamoe-finetune --config RECIPE checkpoint.load=ckpt/base data.kind=sft data.paths=[chat.jsonl]
    torchrun --nproc-per-node 2 -m megamoe.commands.finetune --config RECIPE parallel.tp=2 checkpoint.load=ckpt/base

The model is the checkpoint's own (its meta.json): the recipe adds data, training and LoRA
settings, and a model.* override that differs from the checkpoint is refused. Everything else is
as in megamoe-pretrain (recipe + key=value overrides).
"""
from megamoe.commands.cli import recipe_parser, run_main
from megamoe.core.errors import ConfigError
from megamoe.recipe import load_train_recipe
from megamoe.training.entry import adopt_checkpoint_model, finish, run_training, weights_source


def main(argv: list[str] | None = None) -> None:
    args = recipe_parser(__doc__.strip().splitlines()[0]).parse_args(argv)
    recipe = load_train_recipe(args.config, args.overrides)
    if weights_source(recipe) is None:
        raise ConfigError("checkpoint.load is not set: fine-tuning starts from existing weights "
                          "(megamoe-convert import-hf HF_DIR OUT, then checkpoint.load=OUT)")
    adopt_checkpoint_model(recipe, args.overrides)  # the model is the checkpoint's
    finish(run_training(recipe))


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
