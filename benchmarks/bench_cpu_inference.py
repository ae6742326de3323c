"""CPU inference side by side: ours (float32, bfloat16, int8, int4), llama.cpp (F32, BF16, Q8_0, Q4_0), Transformers.

    make bench-cpu                                       # 124M, 3 rounds (builds llama.cpp once, ~6 min)
    .bench-venv/bin/python ...  is not needed: run it with the project venv:
    .venv/bin/python benchmarks/bench_cpu_inference.py --rounds 3
    .venv/bin/python benchmarks/bench_cpu_inference.py --preset gpt2-xl --rounds 1 --decode-steps 32 --no-hf
    .venv/bin/python benchmarks/bench_cpu_inference.py --quality runs/quickstart --data data/shakespeare
    .venv/bin/python benchmarks/bench_cpu_inference.py --quality runs/quickstart runs/seed1 runs/seed2 --precisions float32 int4
    .venv/bin/python benchmarks/bench_cpu_inference.py --load --preset gpt2-xl --rounds 3   # seconds, peak RSS

Every contender runs in its own subprocess (a fresh process: no allocator or thread-pool state
carried over), one after another, in an order rotated every round; the table gives medians over
rounds, then each precision's decode ratio to llama.cpp round by round (the two run back to back, in one
state of a machine whose bandwidth drifts) and its median. Weights are random (speed does not depend on
them), GPT-2's shapes.
  decode   a 16-token prompt, then N greedy steps; tok/s over the steps only (the prefill not counted)
  decode @L  the same after an L-token prompt (--long-prompt, 768 by default): each step also reads
           L to L + N cached keys and values a layer, as a chat with history does
  prefill  one 512-token forward keeping the last position's logits; tok/s = 512 / time
  batch 8  8 prompts decoded together (ours only): tok/s = 8 N / time over the steps
  roofline the measured memory bandwidth / weight bytes a decode step reads: the ceiling in tok/s; % of it,
           against the bandwidth read just before and after each run (it drifts 2x within minutes)

--no-amx: our contenders (and Transformers) compute as on a CPU without AMX (an AMD EPYC, an older Xeon),
on this machine's memory: oneDNN is capped at AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA), Inductor's GEMM
templates leave out their AMX micro-kernels, and the kernel plans and compiled graphs get caches of
their own under the workdir (neither cache keys on either setting). llama.cpp is built without AMX.

--small-pages: each of ours also runs with its memory in 4 KB pages (GPT2_HUGE_PAGES=0: huge_pages.py
leaves it as the allocators placed it), compiled too under --compile: what 2 MiB pages gain.

--load: loading instead, file to a model ready to generate, each load in a fresh process: its seconds,
and the peak and final RSS above the process before it (libraries imported). Ours: load_for_inference
(each linear packed as it is read; at int4 the quantized weights come from ~/.cache/gpt2/int4, which
the untimed first load fills, and "ours int4, first load" runs the search into an empty cache);
llama.cpp: Llama() with a 64-token context (it maps the GGUF: its RSS counts the pages it touched);
Transformers: GPT2LMHeadModel.from_pretrained.

--quality RUN: a trained model (the quickstart `make demo` trains), its perplexity on the val split at
each precision, ours and llama.cpp's (logits_all=True over the same tokens, on GGUFs of the same
model), the increase over float32 (± its standard error over the windows, each window's log-ratio
paired with the same window's at float32), ours less llama.cpp's increase (± its standard error, paired
by window: whether one is really smaller), the mean KL divergence from that tool's float32 predictions (each
worker computes both, in one process), and top-1 agreement with that tool's float32. With --compile,
ours also through the compiled decode step, one token a step, against the same float32 predictions.
Several models (`make demo`'s and `gpt2 train --preset quickstart --seed N --out runs/seedN`, say): each
one's table, then ours Δ less llama.cpp's averaged over them, which a single model's roundings sway.

llama.cpp comes from llama-cpp-python, built from source in the benchmark venv `.bench-venv` (make
bench-cpu makes it); GGUFs are written by our own exporter (`gpt2 convert`), Q4_0 by
llama_cpp.llama_model_quantize.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_VENV = ROOT / ".bench-venv"
OURS = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8", "int4": "int4"}
LLAMA = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
# Bytes per weight a decode step reads in llama.cpp's block formats (Q8_0: 32 int8 + an f16 scale; Q4_0: 32
# nibbles + an f16 scale); ours are quantize.WEIGHT_BYTES (int4: + a bf16 scale and zero per 32).
LLAMA_BYTES = {"float32": 4, "bfloat16": 2, "int8": 34 / 32, "int4": 18 / 32}
PROMPT_LENGTH = 16  # decode's prompt (prompt_of); decode @L uses --long-prompt


def prompt_of(length: int, row: int = 0) -> list[int]:
    """A fixed prompt of `length` tokens, different for every row of a batch."""
    return [(464 + 7 * i + 31 * row) % 50000 for i in range(length)]


def time_decode(model, rows: int, steps: int, compile: bool, prompt_length: int = PROMPT_LENGTH) -> float:
    """Seconds our engine takes for `steps` greedy steps of `rows` prompts, the prefill not counted."""
    import time

    from gpt2.engine import stream
    prompts = [prompt_of(prompt_length, row) for row in range(rows)]
    generated = stream(model, prompts, max_new_tokens=steps + 1, ignore_eos=True, compile=compile)
    next(generated)  # prefill and the first token: not counted
    start = time.perf_counter()
    for _ in generated:
        pass
    return time.perf_counter() - start



def alternate(label: str, a_ms, b_ms, args, names: tuple[str, str] = ("A", "B")) -> None:
    """An A/B in one process (ab_huge_pages.py, ab_native_ops.py): a_ms(rows, steps) and b_ms(rows, steps), ms
    a step, timed back to back for args.rounds rounds at each of args.rows, the order swapped every round.
    Prints each round, then per row count the medians and the median of the round-by-round ratios B / A."""
    for rows in args.rows:
        a_ms(rows, 8), b_ms(rows, 8)  # warm-up: packages, oneDNN's primitives, first-touch pages
    times = {rows: {"A": [], "B": []} for rows in args.rows}
    for r in range(args.rounds):
        order = [("A", a_ms), ("B", b_ms)][:: 1 if r % 2 == 0 else -1]
        for rows in args.rows:
            for name, ms in order:
                times[rows][name].append(ms(rows, args.steps))
        print(f"  round {r + 1}: " + "   ".join(
            f"{rows} rows A {t['A'][-1]:.2f} B {t['B'][-1]:.2f} ms" for rows, t in times.items()), flush=True)
    for rows, t in times.items():
        ratios = [y / x for x, y in zip(t["A"], t["B"])]
        print(f"{label}, {rows} rows: A ({names[0]}) {statistics.median(t['A']):.2f} ms a step, B ({names[1]}) "
              f"{statistics.median(t['B']):.2f}; B / A by round: median {statistics.median(ratios):.3f}, B faster in "
              f"{sum(x < 1 for x in ratios)} and slower in {sum(x > 1 for x in ratios)} of {len(ratios)} rounds",
              flush=True)


def in_process_ab_main(doc: str, compare, default_precisions: list[str], more_arguments=lambda ap: None) -> None:
    """The command line of an in-process A/B: --precisions, --rows, --rounds, --steps, --model (random GPT-2
    124M weights when absent) and more_arguments' own; then compare(model_dir, precision, args) for each."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=default_precisions, choices=list(OURS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", dest="model_dir", help="an HF directory (default: random GPT-2 124M weights)")
    more_arguments(ap)
    args = ap.parse_args()
    machine_report()
    with tempfile.TemporaryDirectory() as work:
        model_dir = args.model_dir or str(export_model(None, "gpt2", Path(work) / "hf"))
        for precision in args.precisions:
            compare(model_dir, precision, args)

# ---------------------------------------------------------------------------------------------
# workers: one contender in one process, printing one JSON line
# ---------------------------------------------------------------------------------------------

def worker_ours(args) -> dict:
    import time

    import torch

    if args.no_amx:  # before Inductor first picks its vector ISA (cached for the process)
        torch.cpu._is_amx_tile_supported = lambda: False
        torch.cpu._is_amx_fp16_supported = lambda: False
    if args.small_pages:
        os.environ["GPT2_HUGE_PAGES"] = "0"
    from gpt2.kv_cache import KVCache, cache_dtype
    from gpt2.quantize import load_for_inference
    model = load_for_inference(args.model_dir, args.precision, "cpu", kv_dtype=args.kv_dtype)

    def decode(batch: int, prompt_length: int = PROMPT_LENGTH) -> float:
        return batch * args.decode_steps / time_decode(model, batch, args.decode_steps, bool(args.compile),
                                                       prompt_length)

    def prefill() -> float:
        ids = torch.arange(args.prefill).view(1, -1) % 50000
        with torch.inference_mode():
            cache = KVCache.for_model(model, 1, args.prefill)
            start = time.perf_counter()
            model(ids, cache=cache, last_logits_only=True)
            return args.prefill / (time.perf_counter() - start)

    decode(1)  # warm up: oneDNN primitive caches, first-touch pages (and with --compile, compiling)
    if args.compile:
        decode(8)  # its own graph
    prefill()
    return {"decode": decode(1), "prefill": max(prefill() for _ in range(2)), "batch8": decode(8),
            "decode_long": decode(1, args.long_prompt),
            # the decode steps' cache, as kv_dtype "auto" chose it (a compiled step's apart)
            "kv_bytes": torch.empty((), dtype=cache_dtype(model, bool(args.compile))).element_size()}


def worker_hf(args) -> dict:
    import time

    import torch
    import transformers
    model = transformers.GPT2LMHeadModel.from_pretrained(args.model_dir, dtype=torch.float32).eval()

    def decode(prompt_length: int = PROMPT_LENGTH) -> float:
        with torch.inference_mode():
            out = model(torch.tensor([prompt_of(prompt_length)]), use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(args.decode_steps):
                out = model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return args.decode_steps / (time.perf_counter() - start)

    def prefill() -> float:
        ids = torch.arange(args.prefill).view(1, -1) % 50000
        with torch.inference_mode():
            start = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            return args.prefill / (time.perf_counter() - start)

    decode()
    prefill()
    return {"decode": decode(), "prefill": max(prefill() for _ in range(2)), "decode_long": decode(args.long_prompt)}


def worker_llama(args) -> dict:
    import time

    import numpy as np
    from llama_cpp import Llama
    threads = int(os.environ.get("BENCH_THREADS") or os.cpu_count())
    llm = Llama(model_path=args.gguf, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=False, verbose=False)

    n_vocab = llm.n_vocab()

    def next_token() -> int:
        # The last position's logits, read from the context: without logits_all, llama-cpp-python's
        # `scores` is never written (it holds zeros), so an argmax over it would feed token 0 every step.
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    def decode(prompt_length: int = PROMPT_LENGTH) -> float:
        llm.reset()
        llm.eval(prompt_of(prompt_length))
        start = time.perf_counter()
        for _ in range(args.decode_steps):
            llm.eval([next_token()])
        return args.decode_steps / (time.perf_counter() - start)

    def prefill() -> float:
        llm.reset()
        ids = [int(t) for t in np.arange(args.prefill) % 50000]
        start = time.perf_counter()
        llm.eval(ids)
        return args.prefill / (time.perf_counter() - start)

    decode()
    prefill()
    return {"decode": decode(), "prefill": max(prefill() for _ in range(2)), "decode_long": decode(args.long_prompt)}


# ---------------------------------------------------------------------------------------------
# quality workers: perplexity over fixed windows of the val split
# ---------------------------------------------------------------------------------------------

def quality_summary(windows, logprobs, reference=None) -> dict:
    """Over windows (W, T + 1) of token ids: the mean negative log-likelihood of each next token, the
    argmax at every position and, given a reference (the same tool at float32), the mean KL divergence
    KL(reference || this) per position, far less noisy than a perplexity difference (llama.cpp's own
    perplexity tool reports it for the same reason). logprobs(ids (T,)) -> (T, V) float64 log-softmax."""
    import numpy as np
    nll, argmax, kl = [], [], []
    for row in windows.astype(np.int64):
        logp = logprobs(row[:-1])
        nll.append(-logp[np.arange(len(row) - 1), row[1:]])
        argmax.append(logp.argmax(1))
        if reference is not None:
            ref = reference(row[:-1])
            kl.append((np.exp(ref) * (ref - logp)).sum(1))
    return {"nll": float(np.concatenate(nll).mean()), "argmax": np.concatenate(argmax).tolist(),
            "kl": float(np.concatenate(kl).mean()) if kl else 0.0, "window_nll": [float(x.mean()) for x in nll]}


def quality_ours(args) -> dict:
    import numpy as np
    import torch

    from gpt2.engine import StaticDecode
    from gpt2.kv_cache import KVCache
    from gpt2.quantize import load_for_inference

    def logprobs_of(precision: str, compiled: bool = False):
        model = load_for_inference(args.model_dir, precision, "cpu")

        @torch.inference_mode()
        def logprobs(ids: np.ndarray) -> np.ndarray:
            x = torch.from_numpy(ids).view(1, -1)
            # A prefill into the KV cache generation uses (its dtype as kv_dtype "auto" chooses for the
            # eager or the compiled step), as llama.cpp's logits come from its own cache.
            cache = KVCache.for_model(model, 1, x.size(1), compiled=compiled)
            if not compiled:
                logits = model(x, cache=cache)[0]
            else:  # the first token's logits from a 1-token prefill, then each next one through the compiled step
                step = StaticDecode(model, [ids[:1].tolist()], torch.ones(1, x.size(1)), x.size(1))
                logits = torch.cat([model(x[:, :1], cache=cache)[0]]
                                   + [step(x[0, t:t + 1], cache) for t in range(1, x.size(1))])
            return torch.log_softmax(logits.double(), dim=-1).numpy()  # (T, V)
        return logprobs

    reference = logprobs_of("float32") if args.precision != "float32" or args.compile else None
    return quality_summary(np.load(args.windows), logprobs_of(args.precision, args.compile), reference)


def quality_llama(args) -> dict:
    import numpy as np
    from llama_cpp import Llama
    windows = np.load(args.windows)
    T = windows.shape[1] - 1

    def logprobs_of(gguf: str):
        llm = Llama(model_path=gguf, n_ctx=T, n_batch=T, n_ubatch=T, logits_all=True, verbose=False,
                    n_threads=os.cpu_count(), n_threads_batch=os.cpu_count())

        def logprobs(ids: np.ndarray) -> np.ndarray:
            llm.reset()
            llm.eval([int(t) for t in ids])
            logits = np.asarray(llm.scores[:T], dtype=np.float64)  # (T, V)
            top = logits.max(1, keepdims=True)
            return logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
        return logprobs

    reference = logprobs_of(args.reference_gguf) if args.reference_gguf else None
    return quality_summary(windows, logprobs_of(args.gguf), reference)


# ---------------------------------------------------------------------------------------------
# load workers (--load): seconds and memory from the file to a model ready to generate
# ---------------------------------------------------------------------------------------------

def _status_bytes(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_load(load) -> dict:
    """Seconds of load(), and the process's peak and final RSS counted from just before it, in MB.
    The libraries are imported before: the load alone is measured."""
    import time
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM (the peak RSS) restarts from the RSS now
    start = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - start
    peak, after = _status_bytes("VmHWM") - before, _status_bytes("VmRSS") - before
    del model
    return {"seconds": seconds, "peak_mb": peak / 1e6, "rss_mb": after / 1e6}


def load_ours(args) -> dict:
    from gpt2 import quantize
    if args.empty_int4_cache:  # a first load: int4's search runs (quantize.quantize_int4_groups_cached)
        empty = tempfile.TemporaryDirectory(dir=Path(args.model_dir).parent)
        quantize.int4_cache_directory = lambda: Path(empty.name)
    return measure_load(lambda: quantize.load_for_inference(args.model_dir, args.precision, "cpu"))


def load_hf(args) -> dict:
    import transformers
    return measure_load(lambda: transformers.GPT2LMHeadModel.from_pretrained(args.model_dir))


def load_llama(args) -> dict:
    from llama_cpp import Llama
    threads = int(os.environ.get("BENCH_THREADS") or os.cpu_count())
    # A small context: its KV cache and compute buffers stay small beside the weights (ours holds none yet)
    return measure_load(lambda: Llama(model_path=args.gguf, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=threads,
                                      verbose=False))


WORKERS = {"ours": worker_ours, "hf": worker_hf, "llama": worker_llama,
           "quality-ours": quality_ours, "quality-llama": quality_llama,
           "load-ours": load_ours, "load-hf": load_hf, "load-llama": load_llama}


# ---------------------------------------------------------------------------------------------
# the parent: models, GGUFs, rounds, the table
# ---------------------------------------------------------------------------------------------

def machine_report() -> None:
    """Print the CPU, its flags and the memory bandwidth at the start (each run reads its own: speed())."""
    from gpt2.kernels import cpu_features, cpu_model, memory_bandwidth_gbs
    import torch
    bandwidth = memory_bandwidth_gbs()
    no_amx = "; no AMX" * (not any(f.startswith("amx") for f in cpu_features()))
    print(f"cpu: {cpu_model()}; {os.cpu_count()} cores; flags: {', '.join(cpu_features())}{no_amx}")
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s (sum over 512 MiB, best of 5); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")


def make_gguf(model_dir: Path, precision: str, out_dir: Path) -> Path:
    """A GGUF of the HF directory: our writer (`gpt2 convert`, byte-identical to llama.cpp's
    convert_hf_to_gguf.py for GPT-2: formats/gguf.py) for F32/BF16/Q8_0, llama_model_quantize for Q4_0."""
    out = out_dir / f"model-{LLAMA[precision]}.gguf"
    if out.exists():
        return out
    if precision == "int4":
        f32 = make_gguf(model_dir, "float32", out_dir)
        code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
                "p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0; "
                "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        subprocess.run([str(BENCH_VENV / "bin/python"), "-c", code, str(f32), str(out)], check=True,
                       capture_output=True)
    else:
        from gpt2.weights import convert
        convert(str(model_dir), str(out), to="gguf", dtype={"float32": "float32", "bfloat16": "bfloat16",
                                                              "int8": "q8_0"}[precision], output_tensor=False)
    return out


def export_model(src: str | None, preset: str, out: Path) -> Path:
    """An HF directory (with tokenizer files and the n_ctx the converter reads) of `src` or a random preset."""
    import torch

    from gpt2 import GPT, GPTConfig, Tokenizer
    torch.manual_seed(0)
    model = GPT.from_pretrained(src) if src else GPT(GPTConfig.preset(preset))
    model.save_pretrained(str(out), tokenizer=Tokenizer.gpt2())
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "n_ctx": config["n_positions"]}))
    return out


def prepare_workdir(work: Path, src: str | None, preset: str) -> Path:
    """work/hf for this model, with work's GGUFs made from it: reused where work/source.json says they
    are of this very model, else made again (a workdir reused for another preset, or a run trained again,
    would otherwise give the other model's numbers)."""
    source = model_source(src, preset)
    record = work / "source.json"
    if (work / "hf" / "config.json").exists() and record.exists() and json.loads(record.read_text()) == source:
        return work / "hf"
    shutil.rmtree(work / "hf", ignore_errors=True)
    for stale in work.glob("model-*.gguf"):
        stale.unlink()
    model_dir = export_model(src, preset, work / "hf")
    record.write_text(json.dumps(source, indent=1))
    return model_dir


def model_source(src: str | None, preset: str) -> dict:
    """What a workdir's model is made from: the random preset, or src's weight and config files (path,
    size, modification time: a run trained again differs)."""
    if not src:
        return {"preset": preset}
    root = Path(src).resolve()
    if not root.exists():  # a hub name
        return {"src": src}
    model_file = lambda p: p.is_file() and (p.suffix in (".safetensors", ".json", ".bin") or p.name == "LATEST")
    files = [root] if root.is_file() else sorted(filter(model_file, root.rglob("*")))
    return {"src": str(root), "files": {str(p.relative_to(root.parent)): [p.stat().st_size, p.stat().st_mtime_ns]
                                        for p in files}}


def run_worker(kind: str, args, **extra) -> dict:
    python = str(BENCH_VENV / "bin/python") if "llama" in kind else sys.executable
    cmd = [python, __file__, "--worker", kind, "--decode-steps", str(args.decode_steps), "--prefill", str(args.prefill),
           "--long-prompt", str(args.long_prompt)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])  # True: a flag
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(args.no_amx_env if "llama" not in kind else {})}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {extra} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def speed(args, model_dir: Path, gguf_dir: Path, n_weights: int) -> None:
    from gpt2.quantize import WEIGHT_BYTES  # ours: a weight's bytes as stored, the roofline's
    contenders = [("transformers fp32", "hf", {}, None)] * (not args.no_hf)
    kv = f" kv {args.kv_dtype}" * (args.kv_dtype != "auto")
    for p in args.precisions:
        ours = {"precision": p, "model_dir": model_dir, "kv_dtype": args.kv_dtype}
        ours.update({"no_amx": True} if args.no_amx else {})
        contenders.append((f"ours {p}{kv}", "ours", ours, WEIGHT_BYTES[p]))
        if args.compile:  # every precision has a compiled decode step
            contenders.append((f"ours {p}{kv} compiled", "ours", {**ours, "compile": True}, WEIGHT_BYTES[p]))
        if args.small_pages:
            for compiled in [False, True][: 1 + args.compile]:
                contenders.append((f"ours {p}{kv}{' compiled' * compiled} 4 KB pages", "ours",
                                   {**ours, "small_pages": True, **({"compile": True} if compiled else {})},
                                   WEIGHT_BYTES[p]))
        if not args.no_llama:
            contenders.append((f"llama.cpp {LLAMA[p]}", "llama", {"gguf": make_gguf(model_dir, p, gguf_dir)},
                               LLAMA_BYTES[p]))
    from gpt2.kernels import memory_bandwidth_gbs
    results = {name: [] for name, *_ in contenders}
    # The bandwidth drifts from minute to minute (other tenants): each run's roofline is the mean of the
    # bandwidth read just before and just after it (one reading between two runs serves both).
    before = memory_bandwidth_gbs()
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
        for name, kind, extra, _ in order:
            extra = {"model_dir": model_dir, **extra} if kind == "hf" else extra
            run = run_worker(kind, args, **extra)
            after = memory_bandwidth_gbs()
            run["bandwidth"] = (before + after) / 2 * 1e9
            results[name].append(run)
            print(f"  round {r + 1}: {name}: {run} (memory read {before:.1f} GB/s before it, {after:.1f} after)",
                  flush=True)
            before = after
    L = args.long_prompt
    print(f"\n| contender | decode b1 (tok/s) | % of roofline | prefill {args.prefill} (tok/s) | batch 8 (tok/s) "
          f"| batch 8 / b1 | decode @{L} (tok/s) | vs llama.cpp decode | vs llama.cpp prefill | vs llama.cpp @{L} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    med = {name: {k: statistics.median(run[k] for run in runs) for k in runs[0]} for name, runs in results.items()}
    for name, kind, extra, bytes_per_weight in contenders:
        m = med[name]
        roof = ""
        if bytes_per_weight:  # tokens/s over the ceiling of the run's own bandwidth, median over rounds
            fractions = [run["decode"] * n_weights * bytes_per_weight / run["bandwidth"] for run in results[name]]
            roof = f"{100 * statistics.median(fractions):.0f}% of {m['bandwidth'] / (n_weights * bytes_per_weight):.0f}"
        b8 = f"{m['batch8']:.1f} | {m['batch8'] / m['decode']:.2f}x" if "batch8" in m else " | "
        vs = " |  | "
        if kind == "ours" and not args.no_llama:
            peer = med[f"llama.cpp {LLAMA[extra['precision']]}"]
            vs = (f"{m['decode'] / peer['decode']:.2f}x | {m['prefill'] / peer['prefill']:.2f}x | "
                  f"{m['decode_long'] / peer['decode_long']:.2f}x")
        if "kv_bytes" in m:
            name += f" (KV {'float32' if m['kv_bytes'] == 4 else 'bf16'})"
        print(f"| {name} | {m['decode']:.1f} | {roof} | {m['prefill']:.0f} | {b8} | {m['decode_long']:.1f} | {vs} |")
    if not args.no_llama:
        # Ours and llama.cpp at one precision run back to back in every round, so each round's ratio
        # compares them in one state of the machine (its bandwidth drifts from minute to minute).
        print("\nours / llama.cpp decode, round by round:")
        for name, kind, extra, _ in contenders:
            if kind != "ours":
                continue
            pairs = zip(results[name], results[f"llama.cpp {LLAMA[extra['precision']]}"])
            ratios = [ours["decode"] / peer["decode"] for ours, peer in pairs]
            print(f"  {name[5:]}: " + ", ".join(f"{x:.2f}" for x in ratios) + f"; median {statistics.median(ratios):.2f}x")


def loading(args, model_dir: Path, gguf_dir: Path) -> None:
    """--load: each contender loads the model in a fresh process, rounds rotating; medians. A first,
    untimed load of each puts the files in the page cache and measures our kernel plan (kernels.py)."""
    contenders = [("transformers fp32", "load-hf", {"model_dir": model_dir})] * (not args.no_hf)
    for p in args.precisions:
        contenders.append((f"ours {p}", "load-ours", {"precision": p, "model_dir": model_dir}))
        if p == "int4":  # the load above reads the search's results from the cache; this one searches
            contenders.append(("ours int4, first load", "load-ours",
                               {"precision": p, "model_dir": model_dir, "empty_int4_cache": True}))
        if not args.no_llama:
            contenders.append((f"llama.cpp {LLAMA[p]}", "load-llama", {"gguf": make_gguf(model_dir, p, gguf_dir)}))
    for name, kind, extra in contenders:
        run_worker(kind, args, **extra)
    results = {name: [] for name, *_ in contenders}
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
        for name, kind, extra in order:
            results[name].append(run_worker(kind, args, **extra))
            print(f"  round {r + 1}: {name}: {results[name][-1]}", flush=True)
    files = {"safetensors": (model_dir / "model.safetensors").stat().st_size}
    files.update({f"gguf {LLAMA[p]}": make_gguf(model_dir, p, gguf_dir).stat().st_size for p in args.precisions
                  if not args.no_llama})
    print("\nfiles: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in files.items()))
    print("\n| contender | load (s) | peak RSS during the load (MB) | RSS after it (MB) |")
    print("| --- | --- | --- | --- |")
    for name, runs in results.items():
        m = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(f"| {name} | {m['seconds']:.2f} | {m['peak_mb']:.0f} | {m['rss_mb']:.0f} |")


def pooled_gaps(gaps: dict[str, list[tuple[float, float]]], models: int) -> None:
    """Ours Δ less llama.cpp's, per precision, averaged over the models (each ± its standard error; the
    models are independent): one model's gap carries how its roundings happen to fall against that text
    (the first-order part, `int4_error_anatomy.py`), which averages out over models."""
    print(f"\nours Δ ppl less llama.cpp's, the mean over {models} models (± its standard error from the windows; "
          f"± the models' standard deviation / √{models}, which also counts how much the gap varies from model "
          f"to model):")
    for name, per_model in gaps.items():
        n = len(per_model)
        mean = sum(g for g, _ in per_model) / n
        se = math.sqrt(sum(e * e for _, e in per_model)) / n
        spread = math.sqrt(sum((g - mean) ** 2 for g, _ in per_model) / (n - 1) / n) if n > 1 else float("nan")
        below = sum(g < 0 for g, _ in per_model)
        each = ", ".join(f"{g:+.3f}" for g, _ in per_model)
        print(f"  {name}: {mean:+.3f} ± {se:.3f} (windows) ± {spread:.3f} (between models); below llama.cpp's "
              f"on {below} of {n} (models: {each})")


def quality(args, model_dir: Path, gguf_dir: Path) -> dict[str, tuple[float, float]]:
    """The table for one model; returns each precision's ours Δ less llama.cpp's, (mean, standard error)."""
    import numpy as np

    from gpt2.shards import load_split
    config = json.loads((model_dir / "config.json").read_text())
    T = config["n_positions"]
    tokens = load_split(args.data, "val")
    W = min(args.quality_windows, len(tokens) // (T + 1))
    windows = np.stack([tokens[i * (T + 1): (i + 1) * (T + 1)] for i in range(W)]).astype(np.int32)
    path = gguf_dir / "windows.npy"
    np.save(path, windows)
    print(f"\nquality: {W} windows x {T} tokens of {args.data} val ({W * T:,} predictions)")
    print("| precision | ours ppl | ours Δ vs fp32 | ours Δ less llama.cpp's | ours KL vs fp32 | ours top-1 vs fp32 | "
          "llama.cpp | llama.cpp ppl | llama.cpp Δ vs F32 | llama.cpp KL vs F32 | llama.cpp top-1 vs F32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ours = {p: run_worker("quality-ours", args, precision=p, model_dir=model_dir, windows=path) for p in args.precisions}
    compiled = {p: run_worker("quality-ours", args, precision=p, model_dir=model_dir, windows=path, compile=True)
                for p in args.precisions if args.compile}
    f32 = make_gguf(model_dir, "float32", gguf_dir)
    peers = {p: run_worker("quality-llama", args, gguf=make_gguf(model_dir, p, gguf_dir), windows=path,
                           **({"reference_gguf": f32} if p != "float32" else {}))
             for p in args.precisions}
    agree = lambda a, b: np.mean(np.asarray(a["argmax"]) == np.asarray(b["argmax"]))
    by_window = lambda r: np.asarray(r["window_nll"])

    gaps = {}

    def increase(run, reference, peer=None, name=None) -> str:
        """The perplexity's increase over float32, ± its standard error over the windows (paired: the same
        windows at both precisions); with the peer's run and reference, ours less the peer's increase too
        (kept in gaps[name])."""
        ppl = np.exp(reference["nll"])
        diff = by_window(run) - by_window(reference)  # (W,) each window's mean log-ratio
        text = f"{np.exp(run['nll']) - ppl:+.3f} ± {ppl * diff.std(ddof=1) / np.sqrt(len(diff)):.3f}"
        if peer is not None:  # ppl (Δnll_ours - Δnll_peer), paired by window: is one increase really smaller?
            gap = diff - (by_window(peer[0]) - by_window(peer[1]))
            gaps[name] = (float(ppl * gap.mean()), float(ppl * gap.std(ddof=1) / np.sqrt(len(gap))))
            text += f" | {gaps[name][0]:+.3f} ± {gaps[name][1]:.3f}"
        return text

    for p in args.precisions:
        o, l = ours[p], peers[p]
        print(f"| {p} | {np.exp(o['nll']):.3f} | {increase(o, ours['float32'], (l, peers['float32']), p)} | "
              f"{o['kl']:.6f} | {agree(o, ours['float32']):.2%} | {LLAMA[p]} | {np.exp(l['nll']):.3f} | "
              f"{increase(l, peers['float32'])} | {l['kl']:.6f} | {agree(l, peers['float32']):.2%} |")
    for p, o in compiled.items():  # the compiled decode step's predictions, against the same float32 as above
        print(f"| {p} compiled | {np.exp(o['nll']):.3f} | "
              f"{increase(o, ours['float32'], (peers[p], peers['float32']), f'{p} compiled')} | "
              f"{o['kl']:.6f} | {agree(o, ours['float32']):.2%} | | | | | |")
    return {name: gap for name, gap in gaps.items() if not name.startswith("float32")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--long-prompt", type=int, default=768, help="decode @L: the prompt's length (L + steps <= 1024)")
    ap.add_argument("--precisions", nargs="+", default=list(OURS), choices=list(OURS))
    ap.add_argument("--compile", action="store_true",
                    help="also run ours with the compiled decode step, at every precision (compiling is not timed)")
    ap.add_argument("--kv-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="our KV cache's dtype, as load_for_inference takes it (llama.cpp's is f16)")
    ap.add_argument("--small-pages", action="store_true", help="ours in 4 KB pages too (above)")
    ap.add_argument("--no-hf", action="store_true", help="skip Transformers")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (no benchmark venv)")
    ap.add_argument("--no-amx", action="store_true", help="ours and Transformers as on a CPU without AMX (above)")
    ap.add_argument("--quality", metavar="MODEL", nargs="+",
                    help="perplexity at each precision of these trained models (several: each one's table, then "
                         "ours Δ less llama.cpp's over them all)")
    ap.add_argument("--load", action="store_true", help="loading instead: seconds, peak and final RSS (above)")
    ap.add_argument("--data", default="data/shakespeare", help="--quality: a `gpt2 prepare` output with a val split")
    ap.add_argument("--quality-windows", type=int, default=64)
    ap.add_argument("--workdir", default=None, help="keep the HF directory and GGUFs here (default: a temp dir)")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--precision", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--empty-int4-cache", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--windows", help=argparse.SUPPRESS)
    ap.add_argument("--reference-gguf", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
        return
    if not args.no_llama and not (BENCH_VENV / "bin/python").exists():
        sys.exit("no benchmark venv: run `make bench-cpu` (it builds llama-cpp-python into .bench-venv), or pass --no-llama")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_cpu_"))
    work.mkdir(parents=True, exist_ok=True)
    args.no_amx_env = {}
    if args.no_amx:
        args.no_amx_env = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "XDG_CACHE_HOME": str(work / "no-amx" / "cache"),
                           "TORCHINDUCTOR_CACHE_DIR": str(work / "no-amx" / "inductor")}
    machine_report()
    if args.no_amx:
        print("AMX emulated away for ours and Transformers (--no-amx): " +
              ", ".join(f"{k}={v}" for k, v in args.no_amx_env.items()) + "; Inductor without AMX micro-kernels")
    if args.quality:
        gaps = {}
        for i, run in enumerate(args.quality):  # each model its own HF directory and GGUFs
            model_work = work if len(args.quality) == 1 else work / f"model{i}"
            model_work.mkdir(exist_ok=True)
            print(f"\nmodel: {run}")
            for name, gap in quality(args, prepare_workdir(model_work, run, args.preset), model_work).items():
                gaps.setdefault(name, []).append(gap)
        if len(args.quality) > 1:
            pooled_gaps(gaps, len(args.quality))
        return
    model_dir = prepare_workdir(work, None, args.preset)
    if args.load:
        loading(args, model_dir, work)
        return
    config = json.loads((model_dir / "config.json").read_text())
    C, L, V = config["n_embd"], config["n_layer"], config["vocab_size"]
    n_weights = L * 12 * C * C + V * C  # the linears a decode step reads (lm_head included), biases aside
    if args.long_prompt + args.decode_steps + 1 > config["n_positions"]:
        raise SystemExit(f"--long-prompt {args.long_prompt} + --decode-steps {args.decode_steps} + 1 exceeds the "
                         f"model's {config['n_positions']} positions")
    print(f"model: {args.preset} (random weights), {n_weights / 1e6:.1f}M weights read per decode token; "
          f"decode: {PROMPT_LENGTH}-token prompt + {args.decode_steps} steps (decode @{args.long_prompt}: a "
          f"{args.long_prompt}-token prompt); prefill {args.prefill}")
    speed(args, model_dir, work, n_weights)


if __name__ == "__main__":
    main()
