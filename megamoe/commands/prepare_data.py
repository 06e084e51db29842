"""Tokenise raw text or JSONL into a memory-mapped token directory for pretraining.

    megamoe-prepare-data --tokenizer byte --output data/corpus.tokens book.txt more.jsonl
    megamoe-prepare-data --tokenizer path/tokenizer.model --format lines --output out.tokens a.txt
    megamoe-prepare-data --show data/corpus.tokens          # header and the first document

Formats: jsonl (a "text" field per line; --text-key to change), paragraphs (blank-line separated
blocks), lines (one document per line); auto = jsonl for .jsonl/.json, paragraphs otherwise.
A malformed record stops the run with FILE:LINE and leaves no output. See docs/data.md.
"""
import json

from megamoe.cli import run_main, tool_parser
from megamoe.data import TokenFile, load_tokenizer, write_token_file
from megamoe.data.records import FORMATS


def show(path: str, tokenizer_spec: str | None) -> None:
    tf = TokenFile(path)
    print(json.dumps(tf.header, indent=1))
    if tokenizer_spec or tf.header["tokenizer"]["kind"] == "byte":
        tok = load_tokenizer(tokenizer_spec or "byte")
        tf.check_tokenizer(tok)
        print(f"document 0: {tok.decode(tf.document(0).tolist())!r}")


def main(argv: list[str] | None = None) -> None:
    p = tool_parser(__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="*", help="text or JSONL files (.gz allowed)")
    p.add_argument("--output", help="token directory to write (written atomically)")
    p.add_argument("--tokenizer", help="'byte', a SentencePiece .model, a tokenizer.json or a tokenizer directory")
    p.add_argument("--format", default="auto", choices=FORMATS)
    p.add_argument("--text-key", default="text", help="JSONL field holding the document text")
    p.add_argument("--add-bos", action="store_true", help="start every document with the BOS token")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--show", metavar="DIR", help="print a token directory's header and first document")
    args = p.parse_args(argv)
    if args.show:
        return show(args.show, args.tokenizer)
    if not (args.inputs and args.output and args.tokenizer):
        p.error("inputs, --output and --tokenizer are required (or --show DIR)")
    header = write_token_file(args.inputs, args.output, load_tokenizer(args.tokenizer), fmt=args.format,
                              text_key=args.text_key, add_bos=args.add_bos, overwrite=args.overwrite,
                              progress=not args.no_progress)
    print(f"wrote {args.output}: {header['num_documents']} documents, {header['num_tokens']} tokens "
          f"({header['dtype']}, tokenizer {header['tokenizer']['name']})")


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
