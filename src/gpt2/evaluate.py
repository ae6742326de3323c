"""Evaluation: perplexity and bits per byte on raw text or token shards, LAMBADA, HellaSwag.

    gpt2 eval perplexity --model gpt2 wiki.test.raw            # sliding window, stride n_positions/2
    gpt2 eval perplexity --model gpt2 data/fineweb --stride 1024   # the val shards: val loss
    gpt2 eval lambada --model gpt2 --data lambada_test.jsonl
    gpt2 eval hellaswag --model gpt2 --data hellaswag_val.jsonl --json

    from gpt2.evaluate import perplexity, lambada, hellaswag
    result = perplexity(model, tokenizer, ["wiki.test.raw"])    # {"perplexity": ..., "nll": ..., ...}
    result = run_eval(EvalConfig(task="lambada", model="gpt2", data="lambada_test.jsonl"))  # what `gpt2 eval` runs

Perplexity, precisely. A text of N tokens t_0 .. t_{N-1} is cut into windows of L = max_length
input tokens that start every S = stride tokens: window k reads t[kS : kS+L] and its logits
predict t[kS+1 : kS+L+1] (the window's last prediction is the token just past it). A window scores
only the targets no earlier window scored, so every token except t_0 is scored exactly once, and
with at least L - S tokens of context (except in the first window). Then

    nll = (sum of -log p(t_i | context) over the N - 1 scored tokens) / (N - 1)
    perplexity = exp(nll)      bits_per_byte = (N - 1) * nll / ln 2 / (UTF-8 bytes of the text)

This is the sliding window of the Transformers perplexity guide (labels = inputs with the context
set to -100) with two differences, both deliberate: the targets are shifted outside the model, so
a window of L inputs scores up to L tokens and stride == L scores every token (the guide's windows
never score their own first token, so with stride == L it silently drops one token per window);
and the NLL is summed token by token, not averaged per window and re-weighted. With S == L this is
exactly the validation loss of training (x = t[i:i+L], y = t[i+1:i+L+1]). Bits per byte count
every byte of the text, t_0's included, so they don't depend on the tokenizer.

Several FILEs are scored independently (each has its own unscored first token) and pooled: the
totals are summed. A FILE is a UTF-8 text file (encoded as plain text: "<|endoftext|>" is just
text), one llm.c-format token shard (data.py), or a prepared directory whose val shards (from its
manifest.json, else *_val_*.bin) are read as one token stream; in shards <|endoftext|> separates documents and counts 0 bytes.

LAMBADA (`lambada`): the last whitespace-separated word is the target, with its leading space;
the text before it is the context. A hit needs every token of the target to be the argmax
(greedy), as in the GPT-2 paper and lm-eval-harness's lambada_openai. `ppl` is the harness's:
exp(mean over examples of the target's summed NLL); `ppl_per_token` divides by tokens instead.

HellaSwag (`hellaswag`): completion style, each ending scored as a continuation of the context.
acc: the ending with the highest summed log-probability; acc_norm: the highest log-probability per
character of the ending (lm-eval-harness's acc_norm); acc_token_norm: the highest mean
log-probability per token (what llm.c's and nanoGPT's hellaswag.py call acc_norm). With
preprocess="harness" (the default) the context and endings are cleaned exactly as lm-eval-harness
does (`harness_preprocess`): query = preprocess(activity_label + ": " + ctx_a + " " +
ctx_b.capitalize()). With preprocess="none" the raw `ctx` and endings are used (llm.c's style).

Every continuation is tokenized on its own ("context" and " word" separately) and truncated from
the left to the model's context; an empty context is replaced by <|endoftext|>.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gpt2.data import MAGIC as SHARD_MAGIC
from gpt2.data import load_split, read_shard
from gpt2.errors import ConfigError, DataError

TASKS = ("perplexity", "lambada", "hellaswag")
PREPROCESS = ("harness", "none")  # HellaSwag: lm-eval-harness's query and cleanup, or the raw fields


@dataclass
class EvalConfig:
    """`gpt2 eval TASK`: the model, the inputs, and how to batch them; the task's own options last."""
    task: str                            # one of TASKS
    model: str                           # Hugging Face directory, hub name or our checkpoint
    files: list[str] = field(default_factory=list)  # perplexity: text files, token shards, prepared data dirs
    data: str | None = None              # lambada, hellaswag: the one jsonl file
    batch_size: int | None = None        # windows (perplexity, default 4) or sequences (tasks, default 8) per forward
    dtype: str = "float32"               # a name in weights.DTYPES
    device: str | None = None            # default: cuda if available, else cpu
    max_length: int | None = None        # perplexity: window length L (default: n_positions)
    stride: int | None = None            # perplexity: window step S (default: L/2; S = L is the val loss)
    max_tokens: int | None = None        # perplexity: score only the first N tokens of each file
    limit: int | None = None             # lambada, hellaswag: only the first N examples
    preprocess: str = "harness"          # hellaswag: one of PREPROCESS
    progress: bool = False               # a progress bar on stderr

    def __post_init__(self):
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.preprocess not in PREPROCESS:
            raise ConfigError(f"preprocess must be one of {', '.join(PREPROCESS)}, got {self.preprocess!r}")
        for name in ("batch_size", "limit", "max_length", "stride", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if self.task != "perplexity" and self.data is None:
            raise ConfigError(f"{self.task} needs its jsonl file (data)")

    @property
    def inputs(self) -> list:
        """The files this task reads: checked before the model is loaded."""
        return self.files if self.task == "perplexity" else [self.data]


# ---------------------------------------------------------------------------------------------
# reading inputs
# ---------------------------------------------------------------------------------------------

def check_files(paths) -> None:
    """A DataError naming the first path that does not exist (checked before a model is loaded)."""
    if not paths:
        raise DataError("no input files")
    for path in paths:
        if not Path(path).exists():
            raise DataError(f"{path}: no such file or directory")


def read_text(path) -> str:
    """The UTF-8 text of a file, or a DataError saying why not."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text:
        raise DataError(f"{path}: empty file")
    return text


def is_shard(path) -> bool:
    """True if the file starts with the llm.c shard magic number (data.py's format)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int.from_bytes(head, "little") == SHARD_MAGIC


def token_byte_lengths(tokenizer) -> np.ndarray:
    """(n_vocab,) UTF-8 bytes each token stands for; special tokens (document separators) count 0."""
    lengths = np.array([len(tokenizer.decode_bytes([i])) for i in range(tokenizer.n_vocab)], dtype=np.int64)
    for i in tokenizer.special_tokens.values():
        lengths[i] = 0
    return lengths


def count_bytes(tokens, byte_lengths: np.ndarray, chunk: int = 1 << 24) -> int:
    """UTF-8 bytes spelled by a token stream; in chunks, so a large memmapped shard is never copied whole."""
    return sum(int(byte_lengths[np.asarray(tokens[i:i + chunk], dtype=np.int64)].sum())
               for i in range(0, len(tokens), chunk))


def load_tokens(path, tokenizer) -> np.ndarray:
    """The token stream of a text file, a shard, or a directory of val shards (module docstring)."""
    path = Path(path)
    if path.is_dir():
        return load_split(path, "val")
    if not path.is_file():
        raise DataError(f"{path}: no such file or directory")
    if is_shard(path):
        return read_shard(path)
    return np.asarray(tokenizer.encode_ordinary(read_text(path)), dtype=np.int64)


def read_jsonl(path, fields: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line number, object) per line of a JSON-lines file (blank lines skipped), or a DataError.

    Every object must hold `fields`.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason})") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); expected one JSON object per line") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: expected a JSON object per line, got {type(row).__name__}")
        missing = [k for k in fields if k not in row]
        if missing:
            raise DataError(f"{path}:{n}: missing field {missing[0]!r} (each line needs {', '.join(fields)})")
        rows.append((n, row))
    if not rows:
        raise DataError(f"{path}: empty: no examples")
    return rows


# ---------------------------------------------------------------------------------------------
# perplexity
# ---------------------------------------------------------------------------------------------

def sliding_windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_new) per window: inputs t[begin:end] predict t[begin+1:end+1], the last n_new scored.

    Every token but t_0 is scored exactly once (module docstring).
    """
    if not 1 <= stride <= max_length:
        raise DataError(f"stride must be between 1 and max_length ({max_length}), got {stride}")
    windows, prev_end = [], 0
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + max_length, n_tokens - 1)  # the last target is t[end]
        windows.append((begin, end, end - prev_end))
        prev_end = end
        if end == n_tokens - 1:
            break
    return windows


def _device(model) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _progress(total: int, enabled: bool, unit: str):
    from tqdm import tqdm
    return tqdm(total=total, unit=unit, disable=not enabled or total < 2, file=sys.stderr, leave=False,
                dynamic_ncols=True)


@torch.inference_mode()
def sum_nll(model, tokens, max_length: int | None = None, stride: int | None = None,
            batch_size: int = 4, progress: bool = False) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) of a token stream with the sliding window above.

    tokens: a 1-D sequence of ids (numpy array, memmap, list or tensor). Windows of equal length
    are batched batch_size at a time.
    """
    n_positions = model.config.n_positions
    max_length = max_length or n_positions
    if not 1 <= max_length <= n_positions:
        raise DataError(f"max_length must be between 1 and the model's context ({n_positions}), got {max_length}")
    stride = stride or max(1, max_length // 2)
    tokens = np.asarray(tokens)
    if len(tokens) < 2:
        raise DataError(f"at least 2 tokens are needed to score one, got {len(tokens)}")
    if int(tokens.max()) >= model.config.vocab_size:
        raise DataError(f"token id {int(tokens.max())} is outside the model's vocabulary ({model.config.vocab_size})")
    windows = sliding_windows(len(tokens), max_length, stride)
    total, count = 0.0, 0
    bar = _progress(len(windows), progress, "window")
    for batch in _same_length_batches(windows, batch_size):
        s, n = _windows_nll(model, tokens, batch)
        total, count = total + s, count + n
        bar.update(len(batch))
    bar.close()
    return total, count


def _same_length_batches(windows: list[tuple[int, int, int]], batch_size: int):
    """Consecutive windows, up to batch_size at a time, one length per batch (all but the last are max_length)."""
    batch = []
    for window in windows:
        if batch and (len(batch) == batch_size or window[1] - window[0] != batch[0][1] - batch[0][0]):
            yield batch
            batch = []
        batch.append(window)
    if batch:
        yield batch


def _windows_nll(model, tokens, batch: list[tuple[int, int, int]]) -> tuple[float, int]:
    """(summed NLL, tokens scored) of one batch of equal-length windows: each scores only its n_new last targets."""
    T = batch[0][1] - batch[0][0]
    rows = np.stack([np.asarray(tokens[b:e + 1], dtype=np.int64) for b, e, _ in batch])  # (B, T + 1)
    rows = torch.from_numpy(rows).to(_device(model))
    x, y = rows[:, :-1], rows[:, 1:].clone()  # (B, T) each
    for r, (_, _, n_new) in enumerate(batch):
        y[r, : T - n_new] = -100  # context already scored by an earlier window
    logits = model(x)  # (B, T, V)
    scored = y != -100
    nll = F.cross_entropy(logits[scored].float(), y[scored], reduction="none")  # (n scored,)
    return nll.double().sum().item(), int(scored.sum())


def summarize(nll_sum: float, tokens: int, n_bytes: int) -> dict:
    """perplexity, nll (mean per token), tokens, bytes and bits_per_byte from totals."""
    nll = nll_sum / tokens
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": tokens, "bytes": n_bytes,
            "bits_per_byte": nll_sum / math.log(2) / n_bytes if n_bytes else float("nan")}


def perplexity(model, tokenizer, paths, max_length: int | None = None, stride: int | None = None,
               batch_size: int = 4, max_tokens: int | None = None, progress: bool = False) -> dict:
    """Pooled perplexity and bits per byte of text files / shards, plus one entry per path under "files".

    max_tokens: score only the first max_tokens tokens of each path (a quick val loss on big shards).
    """
    if not paths:
        raise DataError("no input files")
    byte_lengths = token_byte_lengths(tokenizer)
    max_length = max_length or model.config.n_positions
    stride = stride or max(1, max_length // 2)
    files, nll_total, tok_total, byte_total = [], 0.0, 0, 0
    for path in paths:
        tokens = load_tokens(path, tokenizer)
        if max_tokens is not None:
            tokens = tokens[:max_tokens]
        if len(tokens) < 2:
            raise DataError(f"{path}: {len(tokens)} token(s); at least 2 are needed to score one")
        if int(tokens.max()) >= len(byte_lengths):
            raise DataError(f"{path}: token id {int(tokens.max())} is outside the tokenizer's vocabulary")
        n_bytes = count_bytes(tokens, byte_lengths)
        s, n = sum_nll(model, tokens, max_length, stride, batch_size, progress)
        files.append({"path": str(path), **summarize(s, n, n_bytes)})
        nll_total, tok_total, byte_total = nll_total + s, tok_total + n, byte_total + n_bytes
    return {**summarize(nll_total, tok_total, byte_total), "max_length": max_length, "stride": stride,
            "files": files}


# ---------------------------------------------------------------------------------------------
# scoring continuations (LAMBADA, HellaSwag)
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def score_continuations(model, requests: list[tuple[list[int], list[int]]], batch_size: int = 8,
                        progress: bool = False) -> list[tuple[float, bool]]:
    """(summed log-probability of the continuation, whether greedy decoding gives it) per request.

    requests: (context ids, continuation ids), the context at least one token. Batches are padded
    on the right, which a causal model never sees, so no mask is needed.
    """
    inputs = [_model_input(ctx, cont, model.config) for ctx, cont in requests]
    # Longest first, as lm-eval-harness does: similar lengths share a batch, and memory peaks at once.
    order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    bar = _progress(len(order), progress, "seq")
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        scores = _score_batch(model, [inputs[i] for i in idx], [requests[i][1] for i in idx])
        for i, score in zip(idx, scores):
            results[i] = score
        bar.update(len(idx))
    bar.close()
    return results


def _model_input(ctx: list[int], cont: list[int], config) -> list[int]:
    """What the model reads to score cont after ctx: the ids without the last, cut from the left to the context."""
    if not ctx or not cont:
        raise ValueError("context and continuation must each have at least one token")
    if max(ctx + cont) >= config.vocab_size:
        raise DataError(f"token id {max(ctx + cont)} is outside the model's vocabulary ({config.vocab_size})")
    if len(cont) > config.n_positions:
        raise DataError(f"a continuation of {len(cont)} tokens does not fit the model's context ({config.n_positions})")
    return (ctx + cont)[-(config.n_positions + 1):-1]  # predicts cont at its end


def _score_batch(model, inputs: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
    """(summed log-probability, greedy hit) of each continuation; inputs longest first, right-padded with 0."""
    device = _device(model)
    x = torch.zeros(len(inputs), len(inputs[0]), dtype=torch.long)  # (B, T)
    for r, ids in enumerate(inputs):
        x[r, : len(ids)] = torch.tensor(ids)
    logits = model(x.to(device))  # (B, T, V)
    scores = []
    for r, (ids, cont) in enumerate(zip(inputs, conts)):
        cont = torch.tensor(cont, device=device)
        n = len(ids)
        logp = F.log_softmax(logits[r, n - len(cont): n].float(), dim=-1)  # (len(cont), V)
        scores.append((logp.gather(1, cont.unsqueeze(1)).sum().item(), bool((logp.argmax(-1) == cont).all())))
    return scores


def _encode_context(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_ordinary(text) if text else [tokenizer.eot_token]


def split_last_word(text: str) -> tuple[str, str] | None:
    """(context, " word"): the last whitespace-separated word keeps the whitespace before it."""
    text = text.rstrip()
    m = re.search(r"\s\S+$", text)
    if m is None:
        return None
    return text[: m.start()], text[m.start():]


def lambada(model, tokenizer, path, batch_size: int = 8, limit: int | None = None, progress: bool = False) -> dict:
    """Last-word accuracy and perplexity on a LAMBADA jsonl of {"text": ...} (module docstring)."""
    rows = read_jsonl(path, ("text",))[:limit]
    requests = []
    for line, row in rows:
        text = row["text"]
        split = split_last_word(text) if isinstance(text, str) else None
        if split is None:
            raise DataError(f"{path}:{line}: \"text\" must be a string of at least two words")
        requests.append((_encode_context(tokenizer, split[0]), tokenizer.encode_ordinary(split[1])))
    scores = score_continuations(model, requests, batch_size, progress)
    correct = sum(greedy for _, greedy in scores)
    nll = [-lp for lp, _ in scores]
    n_target_tokens = sum(len(cont) for _, cont in requests)
    return {"task": "lambada", "examples": len(rows), "correct": correct, "acc": correct / len(rows),
            "ppl": math.exp(sum(nll) / len(rows)), "ppl_per_token": math.exp(sum(nll) / n_target_tokens)}


def harness_preprocess(text: str) -> str:
    """lm-eval-harness's HellaSwag cleanup: WikiHow's " [title]" becomes ". ", other [tags] go."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_example(row: dict, preprocess: str = "harness") -> tuple[str, list[str], int]:
    """(context, endings, label) of one HellaSwag row; raises ValueError with what is wrong."""
    endings, label = row["endings"], row["label"]
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e for e in endings):
        raise ValueError("\"endings\" must be a list of non-empty strings")
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        label = int(label)  # the Hugging Face copy stores labels as strings
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(endings):
        raise ValueError(f"\"label\" must be an integer index into the endings, got {label!r} "
                         "(the test split has no labels; use hellaswag_val.jsonl)")
    if not isinstance(row["ctx"], str):
        raise ValueError("\"ctx\" must be a string")
    if preprocess == "none":
        return row["ctx"], endings, label
    if all(isinstance(row.get(k), str) for k in ("activity_label", "ctx_a", "ctx_b")):
        query = row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize()
    else:
        query = row["ctx"]
    return harness_preprocess(query), [harness_preprocess(e) for e in endings], label


def hellaswag(model, tokenizer, path, batch_size: int = 8, limit: int | None = None,
              preprocess: str = "harness", progress: bool = False, rank: int = 0, world_size: int = 1) -> dict:
    """Completion-style acc, acc_norm (per character) and acc_token_norm on a HellaSwag jsonl.

    rank, world_size: score only examples rank, rank + world_size, ... of the first `limit` (each
    process of a distributed run its share; the caller sums acc * examples over ranks).
    """
    if preprocess not in PREPROCESS:
        raise DataError(f"preprocess must be one of {', '.join(PREPROCESS)}, got {preprocess!r}")
    rows = read_jsonl(path, ("ctx", "endings", "label"))[:limit][rank::world_size]
    examples, requests = [], []
    for line, row in rows:
        try:
            ctx, endings, label = hellaswag_example(row, preprocess)
        except ValueError as e:
            raise DataError(f"{path}:{line}: {e}") from None
        ctx_ids = _encode_context(tokenizer, ctx)
        conts = [tokenizer.encode_ordinary(" " + e) for e in endings]
        examples.append((endings, label, [len(c) for c in conts]))
        requests += [(ctx_ids, c) for c in conts]
    scores = score_continuations(model, requests, batch_size, progress)
    hits = {"acc": 0, "acc_norm": 0, "acc_token_norm": 0}
    k = 0
    for endings, label, n_tokens in examples:
        lp = [scores[k + j][0] for j in range(len(endings))]
        k += len(endings)
        per = {"acc": lp,
               "acc_norm": [s / len(e) for s, e in zip(lp, endings)],  # characters, without the leading space
               "acc_token_norm": [s / n for s, n in zip(lp, n_tokens)]}
        for name, values in per.items():
            hits[name] += max(range(len(values)), key=values.__getitem__) == label  # first maximum wins ties
    n = len(examples)
    return {"task": "hellaswag", "examples": n, "preprocess": preprocess, **{k: v / n if n else 0.0 for k, v in hits.items()}}


# ---------------------------------------------------------------------------------------------
# gpt2 eval
# ---------------------------------------------------------------------------------------------

def run_eval(cfg: EvalConfig) -> dict:
    """`gpt2 eval`: check the inputs, load the model and its tokenizer, run the task; the task's result dict."""
    from gpt2.model import GPT
    from gpt2.tokenizer import Tokenizer
    check_files(cfg.inputs)  # a missing file fails before the model is loaded
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = GPT.from_pretrained(cfg.model, device=device, dtype=cfg.dtype).eval()
    tokenizer = Tokenizer.gpt2(model_dir=cfg.model if Path(cfg.model).is_dir() else None)
    if cfg.task == "perplexity":
        return perplexity(model, tokenizer, cfg.files, cfg.max_length, cfg.stride, cfg.batch_size or 4,
                          cfg.max_tokens, cfg.progress)
    if cfg.task == "lambada":
        return lambada(model, tokenizer, cfg.data, cfg.batch_size or 8, cfg.limit, cfg.progress)
    return hellaswag(model, tokenizer, cfg.data, cfg.batch_size or 8, cfg.limit, cfg.preprocess, cfg.progress)


# The table columns of each task's result.
TABLE_COLUMNS = {
    "perplexity": ["path", "tokens", "bytes", "nll", "perplexity", "bits_per_byte"],
    "lambada": ["task", "examples", "acc", "ppl", "ppl_per_token"],
    "hellaswag": ["task", "examples", "acc", "acc_norm", "acc_token_norm"],
}


def result_table(task: str, result: dict) -> str:
    """run_eval's result for a terminal: perplexity has a row per file (and the pooled row), a task one row."""
    if task != "perplexity":
        return format_table([result], TABLE_COLUMNS[task])
    rows = result["files"] + ([{"path": "all", **result}] if len(result["files"]) > 1 else [])
    return (format_table(rows, TABLE_COLUMNS[task])
            + f"\n(max_length {result['max_length']}, stride {result['stride']})")


# ---------------------------------------------------------------------------------------------
# terminal output
# ---------------------------------------------------------------------------------------------

def format_table(rows: list[dict], columns: list[str]) -> str:
    """A plain aligned table: strings left, numbers right (floats with 4 decimals)."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)
    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[j]) for row in cells)) for j, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows) for c in columns]
    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])
