"""Convert checkpoints between HF and megamoe, streaming one tensor at a time.

    megamoe-convert import-hf HF_DIR OUT_DIR [--tp N --ep N --etp N --pp N] [--placement FILE] [--experts-in-hf]
                              [--keep-fp8]
    megamoe-convert export-hf CKPT_DIR OUT_DIR [--family MODEL_TYPE] [--fp8-blocks 128]
    megamoe-convert export-hf LORA_CKPT_DIR OUT_DIR --merge      # base + adapters merged, one HF model
    megamoe-convert export-peft LORA_CKPT_DIR OUT_DIR [--family MODEL_TYPE]
    megamoe-convert families

import-hf writes a megamoe checkpoint (optionally split for a TP/EP/PP layout) that
megamoe-pretrain / megamoe-finetune load with checkpoint.load=OUT_DIR (with --experts-in-hf
everything but the routed experts, which tiered runs then read from HF_DIR: docs/memory.md).
export-hf takes such a
checkpoint or a training checkpoint (step_XXXXXXXX) and writes safetensors shards, index and
config.json that transformers loads with its Auto classes; with --merge it takes a LoRA
fine-tune's checkpoint, loads its base (the path in its meta.json) and writes the merged model.
export-peft takes a checkpoint of a LoRA fine-tune (adapters only) and writes a PEFT adapter
for the HF family (docs/lora.md). An existing OUT_DIR is replaced (--overwrite) only when it is
a checkpoint megamoe or an HF checkpoint wrote.
"""
import argparse
from pathlib import Path

from megamoe.commands.cli import BASE_HELP, DEBUG_HELP, number_in, run_main, tool_parser


def main(argv: list[str] | None = None) -> None:
    p = tool_parser(__doc__.strip().splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-hf", help="HF directory -> megamoe checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    for flag in ("tp", "ep", "etp", "pp"):
        imp.add_argument(f"--{flag}", type=number_in(int, 1), default=1,
                         help=f"split the checkpoint for parallel.{flag}")
    imp.add_argument("--placement", help="expert placement JSON (megamoe-plan experts --out) to lay the experts out by "
                     "(with its replicas of hot experts, if it lists any)")
    imp.add_argument("--experts-in-hf", action="store_true",
                     help="leave the routed experts in HF_DIR (not read, not written): runs with tiered experts "
                          "(model.moe.expert_store.budget_mib, --expert-budget) read them from there")
    imp.add_argument("--keep-fp8", action="store_true",
                     help="an FP8 checkpoint's linear and expert weights stay e4m3 with their block scales (a frozen "
                          "base for LoRA: about half the bytes of bf16); the rest is dequantised")
    exp = sub.add_parser("export-hf", help="megamoe checkpoint -> HF directory")
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--family", help="HF model_type to write (default: the checkpoint's origin)")
    exp.add_argument("--merge", action="store_true",
                     help="CKPT_DIR is a LoRA checkpoint: write its base with the adapters merged in")
    exp.add_argument("--base", help=BASE_HELP)
    exp.add_argument("--fp8-blocks", type=number_in(int, 1), metavar="B",
                     help="write the family's FP8 format: e4m3 weights with a float32 weight_scale_inv per BxB "
                          "block (128 as released) and quantization_config; weights kept in FP8 (import-hf "
                          "--keep-fp8) and not touched by a fine-tune are written as they were")
    for s in (imp, exp):
        s.add_argument("--overwrite", action="store_true", help="replace OUT_DIR (only a checkpoint megamoe or HF wrote)")
        s.add_argument("--shard-gib", type=number_in(float, 0.001), default=2.0, help="maximum shard size (GiB)")
    peft = sub.add_parser("export-peft", help="LoRA checkpoint -> HF PEFT adapter directory")
    peft.add_argument("ckpt_dir")
    peft.add_argument("out_dir")
    peft.add_argument("--family", help="HF model_type to write for (default: the checkpoint's origin)")
    peft.add_argument("--overwrite", action="store_true", help="replace OUT_DIR (only a checkpoint megamoe or HF wrote)")
    fams = sub.add_parser("families", help="list the supported HF model types")
    for s in (imp, exp, peft, fams):
        s.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    args = p.parse_args(argv)

    from megamoe.convert import FAMILIES, get_family, import_hf

    if args.command == "families":
        get_family("qwen3")  # loads the registry
        for name, fam in sorted(FAMILIES.items()):
            fp8 = "  [maps FP8: block-scaled e4m3]" if fam.maps_fp8 else ""
            print(f"{name:<16} {fam.architecture}  {fam.notes}{fp8}")
    elif args.command == "export-peft":
        from megamoe.core.files import check_replaceable, is_checkpoint_dir
        from megamoe.convert.peft import export_peft_checkpoint

        check_replaceable(Path(args.out_dir), args.overwrite, is_checkpoint_dir, "checkpoint",
                          inputs=[("CKPT_DIR", args.ckpt_dir)])
        out = export_peft_checkpoint(args.ckpt_dir, args.out_dir, family=args.family, overwrite=args.overwrite)
        print(f"wrote PEFT adapter {out} (peft.PeftModel.from_pretrained(hf_model, '{out}'))")
    elif args.command == "import-hf":
        from megamoe.core.placement import read_placement, read_replicas

        placement = read_placement(args.placement) if args.placement else None
        replicas = read_replicas(args.placement) if args.placement else None
        out = import_hf(args.hf_dir, args.out_dir, tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp,
                        overwrite=args.overwrite, shard_bytes=int(args.shard_gib * 2**30), placement=placement,
                        experts=not args.experts_in_hf, keep_fp8=args.keep_fp8, replicas=replicas)
        print(f"wrote megamoe checkpoint {out} (load it with checkpoint.load={out})")
    else:
        out = export(args)
        print(f"wrote HF checkpoint {out}")


def export(args):
    """export-hf: a checkpoint as it is, or a LoRA checkpoint merged into its base."""
    from megamoe.checkpoint.open import open_checkpoint
    from megamoe.inference.load import load_model
    from megamoe.convert import export_hf, to_hf
    from megamoe.core.errors import CheckpointError, ConfigError
    from megamoe.core.files import check_replaceable, is_checkpoint_dir

    inputs = [("CKPT_DIR", args.ckpt_dir)] + ([("--base", args.base)] if args.base else [])
    check_replaceable(Path(args.out_dir), args.overwrite, is_checkpoint_dir, "checkpoint", inputs=inputs)
    shard_bytes = int(args.shard_gib * 2**30)
    ck = open_checkpoint(args.ckpt_dir)
    if not ck.is_lora:
        return export_hf(args.ckpt_dir, args.out_dir, family=args.family, overwrite=args.overwrite,
                         shard_bytes=shard_bytes, fp8_blocks=args.fp8_blocks)
    if not args.merge:
        raise ConfigError(f"{args.ckpt_dir}: a LoRA checkpoint holds adapters only; pass --merge to write its base "
                          f"with the adapters merged in, or use export-peft for a PEFT adapter")
    inputs.append(("base", ck.base(args.base).path))  # the weights the adapters are merged into
    check_replaceable(Path(args.out_dir), args.overwrite, is_checkpoint_dir, "checkpoint", inputs=inputs)
    model = load_model(args.ckpt_dir, merge=True, base=args.base)
    if not (args.family or getattr(model, "hf_origin", None)):
        raise CheckpointError(f"{args.ckpt_dir}: the base weights did not come from an HF checkpoint; name the HF "
                              f"family to export to with --family")
    return to_hf(model, args.out_dir, family=args.family, overwrite=args.overwrite, shard_bytes=shard_bytes,
                 fp8_blocks=args.fp8_blocks, inputs=inputs)


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
