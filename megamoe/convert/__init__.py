"""HF <-> megamoe conversion: declarative tables per family, streaming I/O.

    model = megamoe.convert.from_hf(hf_dir)          # logits = model(input_ids): [b, t, V]
    megamoe.convert.to_hf(model, out_dir)
    megamoe.convert.import_hf(hf_dir, ckpt_dir, tp=2)  # a checkpoint the trainer loads
    megamoe.convert.export_hf(ckpt_dir, out_dir)
    megamoe.convert.export_peft(model, out_dir)      # a LoRA model's adapters as HF PEFT
"""
from megamoe.convert.api import build_model, export_hf, from_hf, import_hf, to_hf  # noqa: F401
from megamoe.convert.family import FAMILIES, get_family  # noqa: F401
from megamoe.convert.peft import export_peft, export_peft_checkpoint  # noqa: F401
