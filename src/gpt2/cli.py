"""The `gpt2` command line: one subcommand per job, each a thin function from flags to a library call.

    gpt2 --help
    gpt2 info gpt2-xl                                   # config, parameters, bytes
    gpt2 convert SRC DST [--to hf|ours|gguf|llmc]       # any format we read -> HF, ours, GGUF or llm.c
    gpt2 tokenize "Hello world"                         # ids and tokens
    gpt2 prepare shakespeare --out data/shakespeare     # text -> llm.c token shards
    gpt2 train --preset quickstart --data data/shakespeare --out runs/quickstart
    gpt2 generate --model runs/quickstart "ROMEO:"      # or --model gpt2 (hub), a directory, ...
    gpt2 serve --model gpt2                             # OpenAI-compatible /v1/completions
    gpt2 eval perplexity --model gpt2 wiki.test.raw     # also: eval lambada, eval hellaswag
    gpt2 inspect gpt2 --mode decode --past 1023         # the architecture sheet
    gpt2 inspect gpt2 --prompt "The cat" --format html  # ... and what a model computes on a prompt
    gpt2 cache [--clear int4 compiled]                  # what ~/.cache/gpt2 holds; clearing parts of it

Each subcommand has an `add_<name>_parser(subparsers)` that declares its flags and a `cmd_<name>(args)`
that turns them into one config and one library call. Flag choices come from the tables that own
them (weights.DTYPES, inspect.MODES, ...). What only one command needs (training, the server,
transformers) is imported inside that command.
"""

from __future__ import annotations

import argparse
import json
import sys

from gpt2.config import GPT2_EOT
from gpt2.evaluate import PREPROCESS
from gpt2.inspect import FORMATS, MODES
from gpt2.weights import DTYPES


# ---------------------------------------------------------------------------------------------
# info / convert (core)
# ---------------------------------------------------------------------------------------------

def add_info_parser(sub):
    p = sub.add_parser("info", help="config, parameter count, dtype and bytes of a model or preset")
    p.add_argument("model", help="preset name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), directory or hub name")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--kernels", action="store_true",
                   help="also show the kernel each linear uses on this CPU, and the timings behind the choice")
    p.add_argument("--kernels-dtype", choices=["float32", "bfloat16", "int8", "int4"], action="append",
                   help="precision for --kernels (repeatable; default: all four)")
    p.set_defaults(func=cmd_info)


def cmd_info(args):
    from gpt2.weights import describe_model
    info = describe_model(args.model)
    if args.kernels:
        info["kernels"] = _kernel_plans(info["config"], args.kernels_dtype or ["float32", "bfloat16", "int8", "int4"])
    if args.json:
        def plan_dict(plan, kv, compiled_kv) -> dict:
            return {**plan.choices_dict(), **{name: {"dtype": str(dtype).removeprefix("torch."), "why": why}
                                              for name, (dtype, why) in [("kv_cache", kv),
                                                                         ("kv_cache_compiled", compiled_kv)]}}
        print(json.dumps({k: v if k != "kernels" else {p: plan_dict(*plan_kv) for p, plan_kv in v.items()}
                          for k, v in info.items()}))
        return
    print(f"model:       {info['source']}")
    print(f"weights:     {info['weights']}")
    print(f"parameters:  {info['parameters']:,}")
    print(f"dtype:       {info['dtype']}")
    print(f"bytes:       {info['bytes']:,} ({info['bytes'] / 2**20:,.1f} MiB)")
    print("config:")
    for key, value in info["config"].items():
        print(f"  {key:34s} {value}")
    for plan, (kv_dtype, why), (compiled_kv_dtype, compiled_why) in info.get("kernels", {}).values():
        print(plan.describe())
        print(f"  KV cache (--kv-dtype auto): {str(kv_dtype).removeprefix('torch.')} ({why})")
        print(f"  KV cache of a compiled step (--compile): {str(compiled_kv_dtype).removeprefix('torch.')} "
              f"({compiled_why})")


def _kernel_plans(config: dict, precisions: list[str]) -> dict:
    """precision -> (kernels.Plan, (KV cache dtype, why), (a compiled step's, why)) for a model of this config,
    as load_for_inference would choose them on this CPU (the model is built on the meta device: shapes only)."""
    import torch

    from gpt2.config import GPTConfig
    from gpt2.kernels import kv_dtype_for, plan_for
    from gpt2.model import GPT
    from gpt2.quantize import plan_keys_are_bf16
    gpt_config = GPTConfig(**config)
    with torch.device("meta"):
        model = GPT(gpt_config)
    plans = {p: plan_for(model, p, device_type="cpu") for p in precisions}
    return {p: (plan, *(kv_dtype_for(plan_keys_are_bf16(plan, gpt_config), gpt_config, compiled)
                        for compiled in (False, True))) for p, plan in plans.items()}


def add_convert_parser(sub):
    from gpt2.formats.gguf import WEIGHT_TYPES
    from gpt2.weights import CONVERT_TARGETS
    p = sub.add_parser("convert", help="convert between Hugging Face, our checkpoints, GGUF, llm.c and OpenAI TF")
    p.add_argument("src", help="a Hugging Face directory or hub name, our checkpoint or run, a .gguf file, an llm.c "
                               ".bin, or OpenAI's TensorFlow checkpoint directory (hparams.json + model.ckpt.*)")
    p.add_argument("dst", help="output: a directory (hf, ours), a .gguf file or an llm.c .bin")
    p.add_argument("--to", choices=[*CONVERT_TARGETS, "gpt2"], default=None,
                   help="hf (Hugging Face), ours (gpt2 is the old name), gguf or llmc; default: .gguf -> gguf, "
                        ".bin -> llmc, anything else -> hf")
    p.add_argument("--dtype", choices=list(dict.fromkeys([*DTYPES, *WEIGHT_TYPES])), default=None,
                   help="weights dtype (q8_0: GGUF only; llm.c: float32 or bfloat16); default: the source's")
    p.add_argument("--no-output-tensor", dest="output_tensor", action="store_false",
                   help="GGUF: leave out output.weight, the copy of token_embd that llama.cpp builds from "
                        "before March 2025 require")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args):
    from gpt2.weights import convert
    out = convert(args.src, args.dst, to=args.to, dtype=args.dtype, output_tensor=args.output_tensor)
    print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------
# tokenize / prepare (tokenizer and data pipeline)
# ---------------------------------------------------------------------------------------------

def add_tokenize_parser(sub):
    p = sub.add_parser("tokenize", help="encode text with GPT-2's tokenizer: tokens, ids or a count")
    p.add_argument("text", nargs="?", help="text to encode (default: --file, else stdin)")
    p.add_argument("--file", help="read the text from this UTF-8 file")
    p.add_argument("--count", action="store_true", help="print only the number of tokens")
    p.add_argument("--ids", action="store_true", help="print only the ids, space separated")
    p.add_argument("--special", choices=["error", "allow", "text"], default="error",
                   help=f"<|endoftext|> in the text: error (default), allow (id {GPT2_EOT}) or text (plain text)")
    p.add_argument("--vocab-dir", help="directory with the vocabulary files (default: resolved, see tokenizer.py)")
    p.set_defaults(func=cmd_tokenize)


def cmd_tokenize(args):
    from gpt2.errors import TokenizerError
    from gpt2.tokenizer import Tokenizer
    if args.text is not None and args.file:
        raise TokenizerError("give TEXT or --file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{args.file}: {e}") from None
    else:
        text = args.text if args.text is not None else sys.stdin.read()
    tok = Tokenizer.gpt2(vocab_dir=args.vocab_dir)
    if args.special == "text":
        ids = tok.encode_ordinary(text)
    else:
        ids = tok.encode(text, allowed_special="all" if args.special == "allow" else frozenset())
    if args.count:
        print(len(ids))
    elif args.ids:
        print(" ".join(map(str, ids)))
    else:
        for i in ids:
            print(f"{i:6d} {tok.decode_bytes([i])!r}")


def add_prepare_parser(sub):
    p = sub.add_parser("prepare", help="tokenize text, .jsonl(.gz/.zst), .parquet, 'shakespeare' or hf:NAME into llm.c "
                                       "shards")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, directories, .jsonl/.jsonl.gz/.jsonl.zst, .parquet, 'shakespeare', or hf:NAME "
                        "(a Hugging Face dataset, streamed)")
    p.add_argument("--out", required=True, help="output directory for *_train_*.bin, *_val_*.bin and manifest.json")
    p.add_argument("--name", help="shard name prefix (default: 'shakespeare' for that dataset, else the --out name)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction of documents for validation (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    p.add_argument("--text-field", default="text",
                   help="field (.jsonl) or column (.parquet, hf:NAME) holding the text (default: text)")
    p.add_argument("--hf-config", help="hf:NAME's configuration, e.g. sample-10BT")
    p.add_argument("--split", dest="hf_split", default="train", help="hf:NAME's split to read (default: train)")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="non-UTF-8 bytes: fail (strict, default) or replace with U+FFFD")
    p.add_argument("--shard-tokens", "--shard-size", dest="shard_size", type=int, default=100_000_000,
                   help="tokens per shard (default 1e8, as llm.c)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after N tokens (a sample of a large corpus)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: CPU count)")
    p.add_argument("--cache-dir", help="named datasets' cache (shakespeare: ~/.cache/gpt2; hf:NAME: the datasets "
                                       "library's, ~/.cache/huggingface/datasets)")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args):
    from gpt2.data import PrepareConfig, prepare
    cfg = PrepareConfig(inputs=list(args.inputs), out_dir=args.out, name=args.name, val_fraction=args.val_fraction,
                        seed=args.seed, text_field=args.text_field, errors=args.errors, shard_size=args.shard_size,
                        max_tokens=args.max_tokens, hf_config=args.hf_config, hf_split=args.hf_split,
                        workers=args.workers, cache_dir=args.cache_dir, progress=True)
    manifest = prepare(cfg)
    t, v = manifest["tokens"]["train"], manifest["tokens"]["val"]
    print(f"wrote {len(manifest['shards']['train'])} train + {len(manifest['shards']['val'])} val shards to {args.out}: "
          f"{t:,} train / {v:,} val tokens, {manifest['documents']['train']} / {manifest['documents']['val']} documents")


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------

def add_inspect_parser(sub):
    p = sub.add_parser("inspect", help="the architecture sheet: every op with shapes, parameters, FLOPs, memory")
    p.add_argument("model", help="preset name (no weights needed), directory or hub name (reads its config only)")
    p.add_argument("--mode", choices=MODES, default="full")
    p.add_argument("--batch", type=int, default=1, help="B sequences")
    p.add_argument("--seq", type=int, default=None,
                   help="T new positions (default: n_positions; decode: 1, the one new token)")
    p.add_argument("--past", type=int, default=None,
                   help="P positions already in the KV cache (prefill: default 0; decode: default n_positions - 1)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="activation and KV-cache dtype for the byte counts")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--prompt", default=None,
                   help="run the model on this text (a preset at random init, a directory with its weights): "
                        "activation statistics per op, attention maps (html, json) and the logit lens")
    p.add_argument("--head", default=None, metavar="LAYER.HEAD",
                   help="with --prompt: the attention map drawn large (default 0.0)")
    p.add_argument("--top-k", type=int, default=5, help="with --prompt: next tokens per layer in the logit lens")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args):
    from gpt2.inspect import InspectConfig, render_sheet
    cfg = InspectConfig(model=args.model, mode=args.mode, batch=args.batch, seq=args.seq, past=args.past,
                        dtype=args.dtype, format=args.format, prompt=args.prompt, head=args.head, top_k=args.top_k)
    print(render_sheet(cfg))


# ---------------------------------------------------------------------------------------------
# eval (evaluate.py)
# ---------------------------------------------------------------------------------------------

def add_eval_parser(sub):
    p = sub.add_parser("eval", help="evaluate: perplexity and bits per byte, LAMBADA, HellaSwag")
    tasks = p.add_subparsers(dest="task", required=True, metavar="TASK")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", required=True, help="Hugging Face directory, hub name or our checkpoint")
    common.add_argument("--batch-size", type=int, default=None,
                        help="windows (perplexity, default 4) or sequences (tasks, default 8) per forward")
    common.add_argument("--dtype", choices=list(DTYPES), default="float32")
    common.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    common.add_argument("--json", action="store_true", help="print one JSON object (the last line of stdout)")
    t = tasks.add_parser("perplexity", parents=[common], help="token perplexity and bits per byte of text or shards")
    t.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files, token shards, or prepared data dirs (val)")
    t.add_argument("--max-length", type=int, default=None, help="window length L (default: n_positions)")
    t.add_argument("--stride", type=int, default=None, help="window step S (default: L/2; S = L is the val loss)")
    t.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of each FILE")
    t = tasks.add_parser("lambada", parents=[common], help="LAMBADA last-word accuracy and perplexity")
    t.add_argument("--data", required=True, help='LAMBADA jsonl, one {"text": ...} per line (lambada_test.jsonl)')
    t.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")
    t = tasks.add_parser("hellaswag", parents=[common], help="HellaSwag completion-style acc and acc_norm")
    t.add_argument("--data", required=True, help="HellaSwag jsonl with ctx, endings, label (hellaswag_val.jsonl)")
    t.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")
    t.add_argument("--preprocess", choices=PREPROCESS, default="harness",
                   help="harness: lm-eval-harness's query and cleanup (default); none: raw ctx and endings")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args):
    import dataclasses
    from gpt2.evaluate import EvalConfig, result_table, run_eval
    fields = {f.name for f in dataclasses.fields(EvalConfig)}  # each flag's dest is the field's name
    cfg = EvalConfig(**{k: v for k, v in vars(args).items() if k in fields}, progress=sys.stderr.isatty())
    result = run_eval(cfg)
    print(json.dumps(result) if args.json else result_table(cfg.task, result))


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------

def add_train_parser(sub):
    p = sub.add_parser("train", help="train from scratch or fine-tune on prepared shards (torchrun for many devices)",
                       description="Flags left out take the preset's value (or TrainConfig's default without --preset).")
    p.add_argument("--preset", help="training preset: quickstart (2 CPU cores, 5 min) or gpt2-124M (GPUs)")
    p.add_argument("--data", help="prepared data directory (gpt2 prepare ... --out DIR)")
    p.add_argument("--out", help="run directory: checkpoints, LATEST, metrics.jsonl, loss.png")
    p.add_argument("--resume", action="store_true", default=None, help="continue from OUT's newest checkpoint")
    g = p.add_argument_group("model (from scratch, unless --init-from)")
    g.add_argument("--model", help="GPTConfig preset for a from-scratch run: gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    for flag in ("n-layer", "n-head", "n-embd", "n-positions", "vocab-size"):
        g.add_argument(f"--{flag}", type=int, help=f"model {flag.replace('-', '_')} (overrides the preset's)")
    g.add_argument("--init-from", help="fine-tune: our checkpoint, a Hugging Face directory or a hub name (gpt2, ...)")
    g.add_argument("--dropout", type=float, help="all three dropout rates (default: the model config's, 0.1 from scratch)")
    g.add_argument("--vocab-multiple", type=int, help="pad the vocabulary rows to a multiple (default: 64)")
    g = p.add_argument_group("batch, optimizer, schedule")
    g.add_argument("--batch-size", type=int, help="sequences per micro-batch per rank")
    g.add_argument("--seq-len", type=int, help="tokens per sequence")
    g.add_argument("--total-batch-tokens", type=int, help="accumulate gradients to this many tokens per step")
    g.add_argument("--data-mode", choices=["random", "sequential"])
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr", type=float, help="final learning rate")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--schedule", choices=["cosine", "wsd"], help="after warmup: cosine or warmup-stable-decay")
    g.add_argument("--decay-fraction", type=float, help="wsd: fraction of the run spent decaying (default 0.2)")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--embedding-lr-scale", type=float, help="lr multiplier for wte/wpe (default 1)")
    g.add_argument("--grad-clip", type=float, help="max gradient norm (0 disables)")
    g.add_argument("--max-steps", type=int)
    g.add_argument("--max-minutes", type=float, help="time budget for the training loop; the schedule follows the clock")
    g = p.add_argument_group("evaluation, checkpoints")
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-batches", type=int)
    g.add_argument("--checkpoint-interval", type=int)
    g.add_argument("--keep-last", type=int, help="checkpoints to keep (0: all)")
    g.add_argument("--hellaswag", metavar="FILE", help="HellaSwag jsonl (hellaswag_val.jsonl): log hellaswag_acc_norm")
    g.add_argument("--hellaswag-interval", type=int, metavar="N",
                   help="steps between HellaSwag evals, a multiple of --eval-interval (default: every eval)")
    g.add_argument("--hellaswag-limit", type=int, metavar="N", help="score only the first N HellaSwag examples")
    g.add_argument("--wandb", metavar="PROJECT", help="log to Weights & Biases (pip install 'gpt2[track]'; "
                                                      "WANDB_MODE=offline works without network)")
    g.add_argument("--tensorboard", metavar="DIR", help="log to TensorBoard in DIR (pip install 'gpt2[track]')")
    g.add_argument("--num-samples", type=int, help="sampled lines at each eval (0 disables)")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    g.add_argument("--peak-tflops", type=float,
                   help="device peak for the MFU estimate (default: known GPUs' bf16 peak; CPU: an assumed 0.3)")
    g = p.add_argument_group("execution")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", choices=["cpu", "cuda"])
    g.add_argument("--dtype", choices=["auto"] + list(DTYPES),
                   help="autocast dtype (weights stay float32); auto (default): the faster here, measured once")
    g.add_argument("--lm-head", metavar="PLAN", help="the fused loss's kernels, LIBRARY:CHUNK_ROWS:WEIGHT_GRAD_ROWS "
                                                     "(e.g. onednn:64:256); auto (default): the fastest here, measured once")
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    g.add_argument("--activation-checkpointing", action="store_true", default=None)
    g.add_argument("--parallel", choices=["ddp", "fsdp"], help="under torchrun: DDP (default) or FSDP2")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="deterministic algorithms (default: on for CPU)")
    g.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.set_defaults(func=cmd_train)


def cmd_train(args):
    import dataclasses
    from gpt2.config import GPTConfig
    from gpt2.train import TrainConfig, preset_configs, train
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if args.preset:
        cfg, model_config = preset_configs(args.preset, **overrides)
    else:
        cfg, model_config = TrainConfig(**overrides), None
    sizes = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")
             if getattr(args, k) is not None}
    if args.model:
        model_config = GPTConfig.preset(args.model, **sizes)
    elif sizes or model_config is None:
        model_config = dataclasses.replace(model_config or GPTConfig(), **sizes)
    train(cfg, None if cfg.init_from else model_config)


# ---------------------------------------------------------------------------------------------
# generate (engine)
# ---------------------------------------------------------------------------------------------

def add_generate_parser(sub):
    p = sub.add_parser("generate", help="generate text from a prompt (greedy by default)")
    p.add_argument("prompt", nargs="?", default="", help="prompt text (empty: start from <|endoftext|>)")
    p.add_argument("--model", required=True, help="Hugging Face directory, hub name (gpt2, ...) or our checkpoint")
    p.add_argument("--stdin", action="store_true", help="read the prompt from standard input")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="sample i uses seed + i")
    p.add_argument("--num-samples", type=int, default=1, help="samples of the same prompt, run as one batch")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); trimmed from the output")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at <|endoftext|>")
    p.add_argument("--truncate", choices=["left"], default=None, help="cut a too-long prompt from the left")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "int8", "int4"], default="float32",
                   help="weights: int8 per channel, int4 per group of 32; kernels chosen by measuring (gpt2 info --kernels)")
    p.add_argument("--verbose", action="store_true", help="print the kernel chosen for each linear, and why")
    p.add_argument("--kv-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the KV cache's dtype (auto: bfloat16 where it rounds nothing and measures no slower here, "
                        "at --dtype bfloat16, int8 and int4; --verbose says which)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step (with --draft: the draft's), at any --dtype (the first "
                        "step compiles, its GEMMs autotuned on a CPU: 20-60 s for GPT-2 124M on 2 cores, once per "
                        "model and machine (int4, int8: and batch size): later runs load the step from "
                        "~/.cache/gpt2/compiled in ~3 s; "
                        "then decode runs 1.2-2.2x faster: BENCHMARKS.md)")
    p.add_argument("--draft", default=None,
                   help="speculative decoding: a smaller model with the same vocabulary (loaded at --draft-dtype), "
                        "or self:int8 / self:int4 (this model's weights, quantized)")
    p.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft proposes per round (the first k)")
    p.add_argument("--draft-dtype", choices=["float32", "bfloat16", "int8", "int4"], default=None,
                   help="weights of a --draft MODEL (default: --dtype)")
    p.add_argument("--fixed-draft-tokens", action="store_true",
                   help="keep k fixed (default: it grows while drafts are accepted and shrinks when rejected)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args):
    from gpt2.config import require_gpt2_vocab
    from gpt2.engine import make_config
    from gpt2.quantize import load_draft, load_for_inference
    from gpt2.tokenizer import Tokenizer
    model = load_for_inference(args.model, dtype=args.dtype, device=args.device, verbose=args.verbose,
                               kv_dtype=args.kv_dtype)
    require_gpt2_vocab(model.config, args.model)
    if args.verbose and args.compile:
        from gpt2.kernels import kv_cache_dtype
        dtype, why = kv_cache_dtype(model, compiled=True) if args.kv_dtype == "auto" else (args.kv_dtype, "as asked")
        print(f"KV cache of the compiled step: {str(dtype).removeprefix('torch.')} ({why})", flush=True)
    draft = None if args.draft is None else load_draft(args.draft, args.model, args.draft_dtype or args.dtype,
                                                       device=args.device, verbose=args.verbose,
                                                       kv_dtype=args.kv_dtype)
    tok = Tokenizer.from_pretrained(args.model)
    prompt = sys.stdin.read() if args.stdin else args.prompt
    cfg = make_config(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, min_p=args.min_p,
                      repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                      presence_penalty=args.presence_penalty, ignore_eos=args.ignore_eos, truncate=args.truncate,
                      compile=args.compile, draft=draft, draft_tokens=args.draft_tokens,
                      adaptive_draft=not args.fixed_draft_tokens)
    ended, speculation = 0, []
    for chunk in _generate_text(model, tok, prompt, cfg, args.num_samples, args.seed, args.stop, args.stream,
                                speculation):
        if chunk is None:  # the end of one sample
            ended += 1
            chunk = "\n" + ("-" * 40 + "\n" if ended < args.num_samples else "")
        print(chunk, end="", flush=True)
    if args.verbose and draft is not None:
        from gpt2.engine import SpeculationStats
        total = sum(speculation, SpeculationStats())
        report = (f"speculation: {total.rounds} rounds, {total.accepted} of {total.proposed} drafts kept "
                  f"({total.acceptance_rate:.1%}), {total.tokens_per_round:.2f} tokens per target forward")
        if cfg.adaptive_draft:  # the costs adaptive k weighed (measured before the first round, then cached)
            from gpt2.engine import draft_costs
            costs = draft_costs(model, draft, cfg.compile)
            report += (f"; a draft step costs {costs.draft_step:.3f} target steps, a verified position "
                       f"{costs.verify_position:.3f}")
        print(report, file=sys.stderr)


def _generate_text(model, tok, prompt: str, cfg, num_samples: int, seed, stop: list[str], stream: bool,
                   speculation: list | None = None):
    """Text chunks of each sample in turn (prompt first), None after each sample. With a draft, each
    Stream's SpeculationStats is appended to `speculation`.

    Sample i draws from its own generator (seed + i), so streaming the samples one at a time prints
    exactly what one batch of all of them generates.
    """
    import dataclasses

    from gpt2.engine import Stream
    from gpt2.tokenizer import TextStream
    ids = tok.encode(prompt, allowed_special="all") or [GPT2_EOT]  # GPT-2 has no BOS: start from <|endoftext|>
    seeds = [None if seed is None else seed + i for i in range(num_samples)]
    groups = [[i] for i in range(num_samples)] if stream else [list(range(num_samples))]
    for rows in groups:
        row_cfg = dataclasses.replace(cfg, seed=[seeds[i] for i in rows] if seed is not None else None)
        steps = Stream(model, [ids] * len(rows), row_cfg)
        texts = [TextStream(tok.stream_decoder(), stop) for _ in rows]
        if stream:
            yield prompt
        for step in steps:
            for r, t in enumerate(step):
                chunk = texts[r].push(t)
                if texts[r].stopped:
                    steps.finish(r)
                if stream and chunk:
                    yield chunk
        if speculation is not None and steps.speculation is not None:
            speculation.append(steps.speculation)
        for text in texts:
            rest = text.flush()  # text held back for a stop string that never came, or a partial character
            yield rest if stream else prompt + text.text
            yield None


# ---------------------------------------------------------------------------------------------
# serve (server.py)
# ---------------------------------------------------------------------------------------------

def add_serve_parser(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "a playground at /) with continuous batching")
    p.add_argument("--model", required=True, help="Hugging Face directory, hub name (gpt2, ...) or our checkpoint")
    p.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another name requests may give as `model` (repeatable; default: the directory's name only)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and the playground page")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions (default: plain 'Role: content' turns)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (1: one at a time)")
    p.add_argument("--max-queue", type=int, default=64, help="sequences waiting for a slot before requests get 429")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens prefilled between two decode steps (0: each prompt whole)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute a repeated prompt prefix instead of reusing its keys and values")
    p.add_argument("--max-kv-mb", type=float, default=None, metavar="MB",
                   help="KV cache limit; requests over it wait, or get 429 if they could never fit")
    p.add_argument("--request-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request's head, then its body, may take to arrive (slower: 408)")
    p.add_argument("--max-connections", type=int, default=256, help="open connections; more get 503")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "int8", "int4"], default="float32")
    p.add_argument("--kv-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the KV cache's dtype: bfloat16 fits twice the tokens in --max-kv-mb (auto: bfloat16 "
                        "where it rounds nothing and measures no slower here)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="speculative decoding for a request decoding alone (not seeded sampling): a smaller "
                        "model with the same vocabulary, or self:int8 / self:int4 (this model's weights at that "
                        "precision)")
    p.add_argument("--draft-dtype", choices=["float32", "bfloat16", "int8", "int4"], default=None,
                   help="weights of a --draft MODEL (default: --dtype)")
    p.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft proposes per round (the first k)")
    p.add_argument("--fixed-draft-tokens", action="store_true", help="keep k fixed (default: adaptive, as in generate)")
    p.add_argument("--compile", action="store_true",
                   help="decode steps through the compiled step, at any --dtype: a graph per batch-row count "
                        "(1, 2, 4, ... --max-batch; float32 and bf16: one package up to 32 rows), all built as "
                        "the server starts, before its first request "
                        "(20-60 s a graph for GPT-2 124M on 2 cores the first time; then each loads from "
                        "~/.cache/gpt2/compiled in ~3 s)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args):
    from gpt2.server import ServerConfig, serve
    serve(ServerConfig(model=args.model, aliases=tuple(args.alias), host=args.host, port=args.port,
                       api_key=args.api_key, chat_template=args.chat_template, max_batch=args.max_batch,
                       max_queue=args.max_queue, prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache,
                       max_kv_mb=args.max_kv_mb, request_timeout=args.request_timeout,
                       max_connections=args.max_connections, dtype=args.dtype, kv_dtype=args.kv_dtype,
                       device=args.device, draft=args.draft, draft_dtype=args.draft_dtype,
                       draft_tokens=args.draft_tokens,
                       adaptive_draft=not args.fixed_draft_tokens, compile=args.compile))


# ---------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------

def add_cache_parser(sub):
    p = sub.add_parser("cache", help="what ~/.cache/gpt2 holds (compiled steps, int4 weights, measurements, "
                                     "the corpus), and clearing it")
    p.add_argument("--clear", nargs="+", metavar="PART", choices=["compiled", "int4", "measurements", "native", "shakespeare"],
                   help="delete these parts (compiled, int4, measurements, native, shakespeare); each is rebuilt when "
                        "next needed")
    p.set_defaults(func=cmd_cache)


def cmd_cache(args):
    from gpt2 import user_cache
    for part in args.clear or []:
        print(f"cleared {part}: {user_cache.clear(part) / 1e6:,.1f} MB")
    print(f"cache: {user_cache.default_cache_dir()}")
    print(f"{'part':<14} {'files':>7} {'MB':>10}  kept within")
    for part, (directory, files, budget) in user_cache.parts().items():
        size = sum(p.stat().st_size for p in files if p.exists())
        limit = "-" if budget is None else f"{budget / 2**30:g} GiB, least recently used dropped first"
        print(f"{part:<14} {len(files):>7} {size / 1e6:>10,.1f}  {limit}")


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------

PARSERS = [  # in the order of a user's journey: look, tokenize, prepare, train, use, measure
    add_info_parser,
    add_convert_parser,
    add_tokenize_parser,
    add_prepare_parser,
    add_train_parser,
    add_generate_parser,
    add_serve_parser,
    add_eval_parser,
    add_inspect_parser,
    add_cache_parser,
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
