"""The `gpt2` command line: one subcommand per job, each a thin function from flags to a library call.

    gpt2 --help
    gpt2 info gpt2-xl
    gpt2 convert SRC DST --dtype bfloat16

Each subcommand has an `add_<name>_parser(subparsers)` that declares its flags and a `cmd_<name>(args)`
that turns them into one config and one library call. Heavy imports (torch, transformers) happen
inside the commands so that `gpt2 --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys


# ---------------------------------------------------------------------------------------------
# info / convert (core)
# ---------------------------------------------------------------------------------------------

def add_info_parser(sub):
    p = sub.add_parser("info", help="config, parameter count, dtype and bytes of a model or preset")
    p.add_argument("model", help="preset name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), directory or hub name")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)


def cmd_info(args):
    from gpt2.weights import describe_model
    info = describe_model(args.model)
    if args.json:
        print(json.dumps(info))
        return
    print(f"model:       {info['source']}")
    print(f"weights:     {info['weights']}")
    print(f"parameters:  {info['parameters']:,}")
    print(f"dtype:       {info['dtype']}")
    print(f"bytes:       {info['bytes']:,} ({info['bytes'] / 2**20:,.1f} MiB)")
    print("config:")
    for key, value in info["config"].items():
        print(f"  {key:34s} {value}")


def add_convert_parser(sub):
    p = sub.add_parser("convert", help="convert between our checkpoints and Hugging Face directories")
    p.add_argument("src", help="our checkpoint, a Hugging Face directory or a hub name")
    p.add_argument("dst", help="output directory")
    p.add_argument("--to", choices=["hf", "gpt2"], default=None,
                   help="output layout: hf (Hugging Face) or gpt2 (ours); default: the other one of SRC's")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.set_defaults(func=cmd_convert)


def cmd_convert(args):
    from gpt2.weights import convert
    out = convert(args.src, args.dst, to=args.to, dtype=args.dtype)
    print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------

PARSERS = [
    add_info_parser,
    add_convert_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2", description="GPT-2: load, train, generate, serve, evaluate, inspect.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from gpt2.errors import GPT2Error
    try:
        result = args.func(args)
    except GPT2Error as e:
        # Expected failures (bad path, corrupt file, bad flag value) get one clear line, no traceback.
        print(f"gpt2 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
