"""Fine-tune a model from existing weights (a converted HF checkpoint or a training checkpoint).

    megamoe-convert import-hf HF_DIR ckpt/base
    megamoe-finetune --config RECIPE checkpoint.load=ckpt/base data.kind=sft data.paths=[chat.jsonl]
    torchrun --nproc-per-node 2 -m megamoe.commands.finetune --config RECIPE parallel.tp=2 checkpoint.load=ckpt/base

Everything else is as in megamoe-pretrain (recipe + key=value overrides).
"""
import torch.distributed as dist

from megamoe.cli import recipe_parser, run_main
from megamoe.errors import ConfigError
from megamoe.training.checkpoint import latest_checkpoint
from megamoe.training.entry import load_train_recipe, run_training


def main(argv: list[str] | None = None) -> None:
    args = recipe_parser(__doc__.strip().splitlines()[0]).parse_args(argv)
    recipe = load_train_recipe(args.config, args.overrides)
    c = recipe.checkpoint
    resuming = c.dir and c.resume and latest_checkpoint(c.dir) is not None
    if not c.load and not resuming:
        raise ConfigError("checkpoint.load is not set: fine-tuning starts from existing weights "
                          "(tools/convert.py import-hf HF_DIR OUT, then checkpoint.load=OUT)")
    summary = run_training(recipe)
    if summary["trainer"].rank == 0:
        last = summary["last"]
        print(f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> {last.get('loss', float('nan')):.4f}")
        print(f"TensorBoard logs: {summary['log_dir']}")
        if c.dir:
            print(f"checkpoints: {c.dir}")
    if dist.is_initialized():
        dist.destroy_process_group()


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
