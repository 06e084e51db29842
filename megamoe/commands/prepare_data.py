"""Tokenise raw text or JSONL into a token directory or a Megatron indexed dataset for pretraining.

    megamoe-prepare-data --tokenizer byte --output data/corpus.tokens book.txt more.jsonl
    megamoe-prepare-data --tokenizer path/tokenizer.model --input-format lines --output out.tokens a.txt
    megamoe-prepare-data --format megatron --tokenizer tok.json --output data/corpus a.jsonl   # corpus.bin + .idx
    megamoe-prepare-data --show data/corpus.tokens          # header and the first document

Output (--format): megamoe (a token directory) or megatron (PREFIX.bin + PREFIX.idx, written with
megatron-core's builder, one document per sequence ending with EOS: what Megatron-LM's
preprocess_data.py --append-eod writes). Input (--input-format): jsonl (a "text" field per line;
--text-key to change), paragraphs (blank-line separated blocks), lines (one document per line);
auto = jsonl for .jsonl/.json, paragraphs otherwise. A malformed record stops the run with
FILE:LINE and leaves no output. See docs/data.md.
"""
import json

from pathlib import Path

from megamoe.commands.cli import run_main, tool_parser
from megamoe.data import TokenFile, load_tokenizer, write_token_file
from megamoe.data.indexed import IndexedTokens, is_indexed_prefix, write_indexed_dataset
from megamoe.data.records import FORMATS
from megamoe.data.tokfile import encoded_documents
from megamoe.core.errors import DataError
from megamoe.core.files import check_apart


def show(path: str, tokenizer_spec: str | None) -> None:
    if is_indexed_prefix(path):
        src = IndexedTokens(path)
        print(json.dumps({"format": "megatron-indexed", "dtype": src.dtype.name, "num_tokens": src.num_tokens,
                          "num_documents": src.num_documents}, indent=1))
        first = src.read(0, src.document_start(1)).tolist()
        print(f"document 0: {load_tokenizer(tokenizer_spec).decode(first)!r}" if tokenizer_spec else f"document 0: {first}")
        return
    tf = TokenFile(path)
    print(json.dumps(tf.header, indent=1))
    if tokenizer_spec or tf.header["tokenizer"]["kind"] == "byte":
        tok = load_tokenizer(tokenizer_spec or "byte")
        tf.check_tokenizer(tok)
        print(f"document 0: {tok.decode(tf.document(0).tolist())!r}")


def main(argv: list[str] | None = None) -> None:
    p = tool_parser(__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="*", help="text or JSONL files (.gz allowed)")
    p.add_argument("--output", help="token directory (--format megamoe) or PREFIX of PREFIX.bin + PREFIX.idx "
                                    "(--format megatron) to write (written atomically)")
    p.add_argument("--tokenizer", help="'byte', a SentencePiece .model, a tokenizer.json or a tokenizer directory")
    p.add_argument("--format", default="megamoe", choices=("megamoe", "megatron"),
                   help="what to write: a megamoe token directory or a Megatron indexed dataset")
    p.add_argument("--input-format", default="auto", choices=FORMATS, help="how the input files hold documents")
    p.add_argument("--text-key", default="text", help="JSONL field holding the document text")
    p.add_argument("--add-bos", action="store_true", help="start every document with the BOS token")
    p.add_argument("--parse-special-tokens", action="store_true",
                   help="special-token strings in the text (<|endoftext|> ...) become control tokens; by default "
                        "they are encoded as the text they are, so a document cannot end or split itself")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--show", metavar="PATH", help="print a token directory's header (or an indexed dataset's "
                                                 "counts, PATH its prefix) and first document")
    args = p.parse_args(argv)
    if args.show:
        return show(args.show, args.tokenizer)
    if not (args.inputs and args.output and args.tokenizer):
        p.error("inputs, --output and --tokenizer are required (or --show DIR)")
    check_outputs(args)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.format == "megatron":
        return write_megatron(args, tokenizer)
    header = write_token_file(args.inputs, args.output, tokenizer, fmt=args.input_format,
                              text_key=args.text_key, add_bos=args.add_bos, overwrite=args.overwrite,
                              progress=not args.no_progress, split_special_tokens=not args.parse_special_tokens)
    print(f"wrote {args.output}: {header['num_documents']} documents, {header['num_tokens']} tokens "
          f"({header['dtype']}, tokenizer {header['tokenizer']['name']})")


def check_outputs(args) -> None:
    """The output (a token directory, or PREFIX.bin and PREFIX.idx) is apart from every input file
    and the tokenizer, whatever --overwrite says."""
    inputs = [("file", path) for path in args.inputs]
    if args.tokenizer != "byte":
        inputs.append(("--tokenizer", args.tokenizer))
    outs = [args.output] if args.format == "megamoe" else [f"{args.output}{ext}" for ext in (".bin", ".idx")]
    for out in outs:
        check_apart(out, inputs, DataError, label=f"--output {out}")


def write_megatron(args, tokenizer) -> None:
    missing = [p for p in args.inputs if not Path(p).is_file()]
    if missing:  # before any output or progress bar
        raise DataError(f"{missing[0]}: file not found")
    docs = encoded_documents([Path(p) for p in args.inputs], tokenizer, args.input_format, args.text_key,
                             args.add_bos, progress=not args.no_progress,
                             split_special_tokens=not args.parse_special_tokens)
    out = write_indexed_dataset(docs, args.output, tokenizer.vocab_size, overwrite=args.overwrite)
    print(f"wrote {args.output}.bin + {args.output}.idx: {out['num_documents']} documents, {out['num_tokens']} "
          f"tokens ({out['dtype']}, tokenizer {tokenizer.name}; train with data.paths=[{args.output}] "
          f"data.tokenizer={args.tokenizer})")


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
