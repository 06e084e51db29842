"""megamoe.data: tokenizers, token files, packed pretraining, SFT and image-caption datasets,
and the global, layout-independent sample order. See docs/data.md.

Core package: imports nothing from megamoe.layers or megamoe.vision; sentencepiece, tokenizers,
transformers, jinja2 and PIL are imported only when used.
"""
from megamoe.data.captions import CaptionRecord, ImageCaptionDataset
from megamoe.data.chat import BUILTIN_TEMPLATE, ChatTemplate, resolve_template, tokenize_chat
from megamoe.data.config import DataConfig
from megamoe.data.blend import Blend, parse_blend
from megamoe.data.indexed import IndexedTokens, write_indexed_dataset
from megamoe.data.loader import (TrainData, build_dataset, build_datasets, build_tokenizer, build_train_data,
                                 check_vocab, concat_micro_batches, holdout)
from megamoe.data.pretrain import PackedDataset
from megamoe.data.samples import collate
from megamoe.data.sampling import BatchLayout, global_order, permute
from megamoe.data.sft import PackedSFTDataset, SFTDataset
from megamoe.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from megamoe.data.tokfile import TokenFile, write_token_file

__all__ = [
    "BUILTIN_TEMPLATE", "BatchLayout", "Blend", "ByteTokenizer", "CaptionRecord", "ChatTemplate", "DataConfig",
    "ImageCaptionDataset", "IndexedTokens", "PackedDataset", "PackedSFTDataset", "SFTDataset", "TokenFile", "Tokenizer",
    "TrainData", "build_dataset", "build_datasets", "build_tokenizer", "build_train_data", "check_vocab", "collate",
    "concat_micro_batches", "global_order", "holdout", "load_tokenizer", "parse_blend", "permute", "resolve_template",
    "tokenize_chat", "write_indexed_dataset", "write_token_file",
]
