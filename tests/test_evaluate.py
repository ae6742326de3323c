"""Evaluation: perplexity against an independent Transformers loop, LAMBADA and HellaSwag on forced logits.

    .venv/bin/pytest tests/test_evaluate.py -q
"""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import transformers

from gpt2 import GPT, ConfigError, DataError, GPTConfig
from gpt2 import evaluate
from gpt2.cli import main
from gpt2.data import write_shard
from gpt2.tokenizer import Tokenizer

from conftest import save_hf_model

V = 50257  # the real vocabulary: text goes through GPT-2's tokenizer
N_POSITIONS = 32

TEXT = (
    "The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building, and the tallest "
    "structure in Paris. Its base is square, measuring 125 metres (410 ft) on each side. During its construction, "
    "the Eiffel Tower surpassed the Washington Monument to become the tallest man-made structure in the world, "
    "a title it held for 41 years until the Chrysler Building in New York City was finished in 1930. "
    "Café crème — naïve résumé. 東京 is far away.\n\nSecond paragraph: it ends here."
)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.gpt2()


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    # A large init makes the predictions depend on the context: at GPT-2's 0.02 they are so near
    # uniform that scoring tokens with the wrong context moves the perplexity by less than 1e-4.
    directory = tmp_path_factory.mktemp("eval_model")
    hf = save_hf_model(directory, seed=3, vocab_size=V, n_layer=2, n_head=2, n_embd=32, n_positions=N_POSITIONS,
                       initializer_range=0.5)
    return hf, directory


@pytest.fixture(scope="module")
def model(hf_and_dir):
    return GPT.from_pretrained(str(hf_and_dir[1])).eval()


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# perplexity
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, L, S", [(2, 4, 4), (10, 4, 4), (11, 4, 4), (100, 16, 8), (101, 16, 5), (7, 16, 1), (50, 8, 1)])
def test_sliding_windows_score_every_token_but_the_first_exactly_once(n, L, S):
    scored = []
    for k, (begin, end, n_new) in enumerate(evaluate.sliding_windows(n, L, S)):
        assert begin == k * S and 0 < end - begin <= L and end <= n - 1
        targets = list(range(begin + 1, end + 1))[-n_new:]
        if k > 0:
            assert targets[0] - begin >= L - S  # at least L - S tokens of context
        scored += targets
    assert scored == list(range(1, n))


def reference_nll(hf, ids, L, S):
    """Sum over i >= 1 of -log p(t_i | t[kS:i]), k = max(0, ceil((i - L) / S)), from Transformers logits.

    Tokens with the same k share one causal forward over t[kS:last i] (logits at i - 1 - kS see t[kS:i] only).
    """
    starts = {}
    for i in range(1, len(ids)):
        starts.setdefault(max(0, -(-(i - L) // S)) * S, []).append(i)
    total = 0.0
    with torch.no_grad():
        for begin, targets in starts.items():
            assert 1 <= targets[-1] - begin <= L
            logp = torch.log_softmax(hf(torch.tensor([ids[begin:targets[-1]]])).logits[0].double(), dim=-1)
            total -= sum(logp[i - 1 - begin, ids[i]].item() for i in targets)
    return total


@pytest.fixture(scope="module")
def hf_ids(tmp_path_factory, tok):
    """TEXT tokenized by Transformers' own GPT2TokenizerFast (from GPT-2's vocabulary files)."""
    d = tok.save_pretrained(tmp_path_factory.mktemp("vocab"))
    ids = transformers.GPT2TokenizerFast.from_pretrained(d)(TEXT)["input_ids"]
    assert len(ids) > 3 * N_POSITIONS
    return ids


@pytest.mark.parametrize("L, S, batch_size", [(32, 32, 1), (32, 32, 4), (32, 16, 3), (24, 7, 5), (8, 1, 16)])
def test_perplexity_equals_an_independent_transformers_loop(model, hf_and_dir, tok, text_file, hf_ids, L, S, batch_size):
    result = evaluate.perplexity(model, tok, [text_file], max_length=L, stride=S, batch_size=batch_size)
    expected_sum = reference_nll(hf_and_dir[0], hf_ids, L, S)
    n = len(hf_ids) - 1
    assert result["tokens"] == n
    assert result["perplexity"] == pytest.approx(math.exp(expected_sum / n), rel=1e-4)
    assert result["nll"] == pytest.approx(expected_sum / n, rel=1e-5)
    assert result["bytes"] == len(TEXT.encode("utf-8"))
    assert result["bits_per_byte"] == pytest.approx(expected_sum / math.log(2) / len(TEXT.encode("utf-8")), rel=1e-4)
    assert (result["max_length"], result["stride"]) == (L, S)


def test_overlapping_windows_give_more_context_so_a_different_number(model, tok, text_file):
    # Guards against a stride that is silently ignored.
    a = evaluate.perplexity(model, tok, [text_file], max_length=16, stride=16)["nll"]
    b = evaluate.perplexity(model, tok, [text_file], max_length=16, stride=4)["nll"]
    assert abs(a - b) > 1e-4


def test_defaults_are_the_context_length_and_half_of_it(model, tok, text_file):
    result = evaluate.perplexity(model, tok, [text_file])
    assert (result["max_length"], result["stride"]) == (N_POSITIONS, N_POSITIONS // 2)
    assert result == evaluate.perplexity(model, tok, [text_file], max_length=N_POSITIONS, stride=N_POSITIONS // 2)


def test_shards_score_like_the_text_and_files_pool(model, tok, text_file, tmp_path):
    ids = tok.encode_ordinary(TEXT)
    data = tmp_path / "data"
    data.mkdir()
    # Two val shards are one stream; the <|endoftext|> separator counts no bytes.
    write_shard(data / "x_val_000000.bin", [tok.eot_token] + ids[:40])
    write_shard(data / "x_val_000001.bin", ids[40:])
    write_shard(data / "x_train_000000.bin", ids[:5])  # never read
    from_text = evaluate.perplexity(model, tok, [text_file], max_length=16, stride=8)
    from_dir = evaluate.perplexity(model, tok, [data], max_length=16, stride=8)
    assert from_dir["tokens"] == from_text["tokens"] + 1 and from_dir["bytes"] == from_text["bytes"]
    single = tmp_path / "one.bin"
    write_shard(single, ids)
    from_shard = evaluate.perplexity(model, tok, [single], max_length=16, stride=8)
    assert from_shard["nll"] == pytest.approx(from_text["nll"], rel=1e-6)

    both = evaluate.perplexity(model, tok, [text_file, single], max_length=16, stride=8)
    assert both["tokens"] == 2 * from_text["tokens"] and both["bytes"] == 2 * from_text["bytes"]
    assert both["nll"] == pytest.approx(from_text["nll"], rel=1e-6) and len(both["files"]) == 2

    first = evaluate.perplexity(model, tok, [single], max_length=16, stride=8, max_tokens=20)
    assert first["tokens"] == 19 and first["bytes"] == len(tok.decode_bytes(ids[:20]))


# ---------------------------------------------------------------------------------------------
# LAMBADA and HellaSwag on forced logits
# ---------------------------------------------------------------------------------------------

HIGH = 10.0
SINK = 0  # "!": the prediction after any token the table doesn't name
LP_HIT = HIGH - math.log(math.exp(HIGH) + V - 1)  # log p of the forced token
LP_MISS = -math.log(math.exp(HIGH) + V - 1)       # log p of any other token


class ForcedBigram(nn.Module):
    """The GPT interface with forced logits: after token a, next_token[a] gets HIGH and every other token 0."""

    def __init__(self, table: dict[int, int], n_positions: int = 64):
        super().__init__()
        self.config = GPTConfig(n_layer=1, n_head=1, n_embd=1, n_positions=n_positions, vocab_size=V)
        next_token = torch.full((V,), SINK, dtype=torch.long)
        for a, b in table.items():
            next_token[a] = b
        self.register_buffer("next_token", next_token)

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, V)
        return logits.scatter_(2, self.next_token[idx].unsqueeze(-1), HIGH)  # (B, T, V)


def chain(tok, before: str, word: str, broken_at: int | None = None) -> dict[int, int]:
    """Table entries making `word` the greedy continuation after `before`, except at token broken_at."""
    prev, ids = tok.encode_ordinary(before)[-1], tok.encode_ordinary(word)
    assert len(set(ids)) == len(ids) and SINK not in ids
    table = {}
    for j, t in enumerate([prev] + ids[:-1]):
        table[t] = ids[j] if j != broken_at else SINK
    return table


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_lambada_accuracy_needs_every_target_token_and_ppl_is_per_example(tok, tmp_path):
    long_a, long_b = " antidisestablishmentarianism", " hippopotomonstrous"
    rows = [{"text": "The cat sat on the mat"},            # " mat" forced: hit
            {"text": "I like green apples"},               # " green" forces " zebra": miss
            {"text": "She studied" + long_a},              # 5 tokens, all forced: hit
            {"text": "He wrote" + long_b + "  \n"}]        # 4 tokens, the second not forced: miss
    table = {**chain(tok, "on the", " mat"), tok.encode_ordinary(" green")[0]: tok.encode_ordinary(" zebra")[0],
             **chain(tok, " studied", long_a), **chain(tok, " wrote", long_b, broken_at=1)}
    model = ForcedBigram(table)
    nll = [-LP_HIT, -LP_MISS, -5 * LP_HIT, -(3 * LP_HIT + LP_MISS)]
    n_tokens = 1 + 1 + 5 + 4
    path = write_jsonl(tmp_path / "lambada.jsonl", rows)
    for batch_size in (1, 3):
        result = evaluate.lambada(model, tok, path, batch_size=batch_size)
        assert result["examples"] == 4 and result["correct"] == 2 and result["acc"] == 0.5
        assert result["ppl"] == pytest.approx(math.exp(sum(nll) / 4), rel=1e-4)
        assert result["ppl_per_token"] == pytest.approx(math.exp(sum(nll) / n_tokens), rel=1e-4)
    assert evaluate.lambada(model, tok, path, limit=1)["acc"] == 1.0


def test_split_last_word_keeps_the_space_with_the_target():
    assert evaluate.split_last_word("the cat sat on the mat") == ("the cat sat on the", " mat")
    assert evaluate.split_last_word("he said \"go home.\"\n") == ("he said \"go", " home.\"")
    assert evaluate.split_last_word("alone") is None


def test_hellaswag_acc_sums_acc_norm_divides_by_characters(tok, tmp_path):
    # Example 1 (label 1): a short unforced ending has the best sum (acc is wrong), the long forced one
    # has the best log-probability per character and per token (acc_norm, acc_token_norm are right).
    # Example 2 (label 0): the fully forced ending wins everything.
    # Example 3 (label 1): one unforced 16-character token has the best sum and the best per character,
    # but " sat on the mat" (one miss, three forced) has the best mean per token: acc_token_norm is wrong.
    rows = [{"ctx": "A man is sitting on a roof. he", "label": 1,
             "endings": ["no", "sat on the mat", "big dog", "tiny cup"]},
            {"ctx": "The sky is", "label": "0",
             "endings": ["blue today", "green", "red", "purple and pink"]},
            {"ctx": "Then he", "label": 1,
             "endings": ["sat on the mat", "responsibilities", "big dog", "tiny cup"]}]
    table = {**chain(tok, " he", " sat on the mat", broken_at=0), **chain(tok, " is", " blue today")}
    model = ForcedBigram(table)
    path = write_jsonl(tmp_path / "hs.jsonl", rows)
    result = evaluate.hellaswag(model, tok, path, batch_size=3, preprocess="none")
    assert result == {"task": "hellaswag", "examples": 3, "preprocess": "none",
                      "acc": 2 / 3, "acc_norm": 1.0, "acc_token_norm": 2 / 3}
    # The scores themselves: " sat on the mat" is one miss then three forced tokens.
    ctx = tok.encode_ordinary(rows[0]["ctx"])
    (lp, greedy), = evaluate.score_continuations(model, [(ctx, tok.encode_ordinary(" sat on the mat"))])
    assert lp == pytest.approx(LP_MISS + 3 * LP_HIT, rel=1e-5) and not greedy


def test_hellaswag_harness_preprocessing():
    assert evaluate.harness_preprocess(" How to cook [title] Boil water. [step] Add salt.  ") == \
        "How to cook. Boil water. Add salt."
    row = {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
           "ctx": "A man is sitting on a roof. he", "endings": ["is [header] up.", "b"], "label": 0}
    assert evaluate.hellaswag_example(row) == ("Roof shingle removal: A man is sitting on a roof. He", ["is up.", "b"], 0)
    assert evaluate.hellaswag_example(row, "none") == (row["ctx"], row["endings"], 0)


def test_padding_in_a_batch_changes_no_score(model, tok):
    requests = [(tok.encode_ordinary(c), tok.encode_ordinary(w)) for c, w in
                [("The tower is 324 metres tall and", " wide"), ("Paris", " is a city"), ("A", " b c d e f g")]]
    one = evaluate.score_continuations(model, requests, batch_size=1)
    batched = evaluate.score_continuations(model, requests, batch_size=3)
    for (a, ga), (b, gb) in zip(one, batched):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5) and ga == gb


# ---------------------------------------------------------------------------------------------
# bad files and the CLI
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("", "empty: no examples"),
    ("\n  \n", "empty: no examples"),
    ("{\"text\": \"a b\"}\nnot json\n", r":2: not valid JSON"),
    ("[\"a\", \"b\"]\n", r":1: expected a JSON object per line, got list"),
    ("{\"txt\": \"a b\"}\n", r":1: missing field 'text'"),
    ("{\"text\": \"oneword\"}\n", r":1: \"text\" must be a string of at least two words"),
    ("{\"text\": 3}\n", r":1: \"text\" must be a string"),
])
def test_bad_lambada_files_give_clear_errors(tok, tmp_path, content, message):
    path = tmp_path / "lambada.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message):
        evaluate.lambada(ForcedBigram({}), tok, path)


@pytest.mark.parametrize("row, message", [
    ({"ctx": "a", "endings": ["x", "y"]}, "missing field 'label'"),
    ({"ctx": "a", "endings": ["x", "y"], "label": ""}, "test split has no labels"),
    ({"ctx": "a", "endings": ["x", "y"], "label": 2}, "integer index into the endings, got 2"),
    ({"ctx": "a", "endings": "x", "label": 0}, "\"endings\" must be a list"),
])
def test_bad_hellaswag_files_give_clear_errors(tok, tmp_path, row, message):
    path = write_jsonl(tmp_path / "hs.jsonl", [row])
    with pytest.raises(DataError, match=message):
        evaluate.hellaswag(ForcedBigram({}), tok, path)


def test_bad_perplexity_inputs_give_clear_errors(model, tok, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "ok.txt").write_text("Hello world, again")
    (tmp_path / "one.txt").write_text("Hello")
    (tmp_path / "nodata").mkdir()
    write_shard(tmp_path / "cut.bin", [1, 2, 3])
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate(1024 + 4)
    for name, message in [("missing.txt", "no such file"), ("empty.txt", "empty file"), ("latin1.txt", "not UTF-8"),
                          ("one.txt", "at least 2 are needed"), ("nodata", "no val shards"),
                          ("cut.bin", "truncated or corrupt")]:
        with pytest.raises(DataError, match=message):
            evaluate.perplexity(model, tok, [tmp_path / name])
    with pytest.raises(DataError, match="stride must be between 1 and max_length"):
        evaluate.perplexity(model, tok, [tmp_path / "ok.txt"], max_length=8, stride=9)
    with pytest.raises(DataError, match="max_length must be between 1 and the model's context"):
        evaluate.sum_nll(model, [1, 2, 3], max_length=N_POSITIONS + 1)


def test_cli_json_contract_and_table(hf_and_dir, text_file, tmp_path, capsys, model, tok):
    directory = str(hf_and_dir[1])
    assert main(["eval", "perplexity", "--model", directory, str(text_file), "--json", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert {"perplexity", "nll", "tokens", "bits_per_byte"} <= result.keys()
    assert result["perplexity"] == pytest.approx(math.exp(result["nll"]))
    assert result["nll"] == pytest.approx(evaluate.perplexity(model, tok, [text_file])["nll"], rel=1e-6)
    assert (result["max_length"], result["stride"]) == (N_POSITIONS, N_POSITIONS // 2)

    assert main(["eval", "perplexity", "--model", directory, str(text_file), "--max-length", "8", "--stride", "8"]) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table and "bits_per_byte" in table and "stride 8" in table

    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": "The cat sat on the mat"}, {"text": "I like green apples"}])
    assert main(["eval", "lambada", "--model", directory, "--data", str(lam), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["examples"] == 2 and {"acc", "ppl"} <= result.keys()

    hs = write_jsonl(tmp_path / "h.jsonl", [{"ctx": "The sky is", "endings": ["blue", "green"], "label": 0}])
    assert main(["eval", "hellaswag", "--model", directory, "--data", str(hs), "--json", "--preprocess", "none"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["examples"] == 1 and {"acc", "acc_norm"} <= result.keys()

    # Bad files: exit status 2 and one line on stderr, checked before the model is loaded.
    assert main(["eval", "hellaswag", "--model", "no/such/model", "--data", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.jsonl: no such file" in err
    assert main(["eval", "lambada", "--model", directory, "--data", str(hs)]) == 2
    assert "missing field 'text'" in capsys.readouterr().err


def test_eval_config_is_what_the_cli_runs(hf_and_dir, text_file, capsys):
    directory = str(hf_and_dir[1])
    cfg = evaluate.EvalConfig(task="perplexity", model=directory, files=[str(text_file)], max_length=8, stride=8)
    result = evaluate.run_eval(cfg)
    assert main(["eval", "perplexity", "--model", directory, str(text_file), "--max-length", "8", "--stride", "8"]) == 0
    assert capsys.readouterr().out == evaluate.result_table("perplexity", result) + "\n"
    for bad, message in [(dict(task="mmlu"), "task must be one of"), (dict(batch_size=0), "batch_size must be at least 1"),
                         (dict(stride=-1), "stride must be at least 1"), (dict(preprocess="raw"), "preprocess must be"),
                         (dict(task="lambada"), "lambada needs its jsonl file")]:
        with pytest.raises(ConfigError, match=message):
            evaluate.EvalConfig(**{"task": "perplexity", "model": directory, **bad})
    assert main(["eval", "perplexity", "--model", directory, str(text_file), "--max-tokens", "0"]) == 2
    assert "max_tokens must be at least 1" in capsys.readouterr().err


def test_cli_stdout_last_line_is_json_in_a_real_process(hf_and_dir, text_file):
    proc = subprocess.run([sys.executable, "-m", "gpt2", "eval", "perplexity", "--model", str(hf_and_dir[1]),
                           str(text_file), "--json", "--stride", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stride"] == 4 and result["tokens"] > 0 and result["bits_per_byte"] > 0
