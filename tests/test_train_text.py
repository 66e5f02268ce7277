"""Issue 32, item 6: train.py --text / --eval-text with a tokenizer.

The text is tokenized once into a token file beside it (named by a hash of the
tokenizer and the text) and read as --data reads one. Most checks run train.py's
--preflight in this process (it builds the dataset as training does, and so
tokenizes); the training runs are spawned gloo worlds."""
from __future__ import annotations

import glob
import json
import math
import os
import random

import numpy as np
import pytest

from autopar.train import main, text
from train_worlds import EXAMPLES, GPT_TINY, write_plan

WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang in old green trees "
         "near one quiet river under blue skies").split()


def _word_tokenizer(path, words=WORDS):
    """A WordLevel tokenizer over `words` (+ [UNK], <|endoftext|>), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainer=trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(path))
    return tok


def _prose(path, n_words, seed=0):
    """Lines of random words (some indented, some blank), as a plain text file."""
    rng = random.Random(seed)
    lines = []
    for i in range(0, n_words, 9):
        line = " ".join(rng.choice(WORDS) for _ in range(min(9, n_words - i)))
        lines.append(("  " if i % 27 == 0 else "") + line + ("\n" if i % 45 == 0 else ""))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _document_ids(tok, path):
    """What the token file must hold for one plain text file: its ids, then <|endoftext|>."""
    with open(path, newline="") as f:
        return tok.encode(f.read(), add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """gpt_tiny (vocabulary 128, sequence 16) on one rank, global batch 2: 33 tokens at least."""
    return write_plan(str(tmp_path_factory.mktemp("plan") / "plan.json"), micro_batch_size=2)


def _preflight(plan, *argv, spec=GPT_TINY):
    return main(spec, plan, ["--preflight", *argv])


def _cache(path):
    found = [p for p in glob.glob(f"{path}.*") if ".tmp-" not in p]
    assert len(found) == 1, found
    return found[0]


def test_text_is_tokenized_once_into_the_tokenizers_ids(tmp_path, plan, capfd, monkeypatch):
    """The token file holds exactly the tokenizer's ids for the text and the end-of-text id
    after each document (a plain file is one, a .jsonl line another), in the dtype the
    vocabulary needs; pieces cut at line starts encode as the whole text does; a progress
    line with MB done / total; a second run reuses the file; an edited text makes a new one."""
    tok = _word_tokenizer(tmp_path / "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    prose = _prose(tmp_path / "train.txt", 400)
    docs = ["the cat sat", "a dog ran to the park", "birds sang"]
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    monkeypatch.setattr(text, "CHUNK_BYTES", 200)  # several pieces per file
    monkeypatch.setattr(text, "PROGRESS_EVERY_S", 0.0)
    argv = ["--text", prose, str(jsonl), "--tokenizer", f"file:{tmp_path / 'tokenizer.json'}"]
    assert _preflight(plan, *argv) == 0
    err = capfd.readouterr().err
    cache = _cache(prose)
    assert cache.endswith(".u16") and os.path.dirname(cache) == str(tmp_path)
    want = _document_ids(tok, prose)
    for d in docs:
        want += tok.encode(d, add_special_tokens=False).ids + [eos]
    assert np.fromfile(cache, dtype=np.uint16).tolist() == want
    assert f"{len(want):,} tokens in {cache}" in err
    assert "MB (" in err and " / " in err  # the progress line: MB done / total

    stamp = os.stat(cache).st_mtime_ns
    assert _preflight(plan, *argv) == 0
    assert f"reusing {cache}" in capfd.readouterr().err and os.stat(cache).st_mtime_ns == stamp

    with open(prose, "a") as f:
        f.write("the end\n")
    assert _preflight(plan, *argv) == 0
    assert len([p for p in glob.glob(f"{prose}.*")]) == 2  # another text, another token file


def test_hugging_face_folder_and_model_file_tokenizers(tmp_path, plan, capfd):
    """--tokenizer FOLDER (transformers.AutoTokenizer, its eos_token joining documents) and
    the model file's tokenizer() (the default when it defines one) give their own ids."""
    from transformers import PreTrainedTokenizerFast

    tok = _word_tokenizer(tmp_path / "tokenizer.json")
    folder = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="[UNK]").save_pretrained(folder)
    prose = _prose(tmp_path / "a.txt", 200)
    assert _preflight(plan, "--text", prose, "--tokenizer", str(folder)) == 0
    want = _document_ids(tok, prose)
    assert np.fromfile(_cache(prose), dtype=np.uint16).tolist() == want

    model_file = tmp_path / "chars.py"
    model_file.write_text(f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom gpt import gpt_tiny\n"
                          "class Chars:\n    eos_token_id = 127\n    vocab_size = 128\n"
                          "    def encode(self, s):\n        return [ord(c) % 120 for c in s]\n"
                          "def tokenizer():\n    return Chars()\n")
    chars = tmp_path / "b.txt"
    chars.write_text("hello, world\n" * 5)
    assert _preflight(plan, "--text", str(chars), spec=f"{model_file}:gpt_tiny") == 0
    assert np.fromfile(_cache(chars), dtype=np.uint16).tolist() == [ord(c) % 120 for c in chars.read_text()] + [127]
    assert "the model file's tokenizer()" in capfd.readouterr().err


def test_each_text_error_is_one_line_and_its_fix(tmp_path, plan, capfd, monkeypatch):
    """No tokenizer, a vocabulary larger than the embedding, an unreadable file, a
    tokenizer name with no local copy and no network, too few tokens for one global
    batch, a bad .jsonl line, and --text beside --data: each refused before training."""
    _word_tokenizer(tmp_path / "tokenizer.json")
    _word_tokenizer(tmp_path / "big.json", words=[f"w{i}" for i in range(200)])
    prose = _prose(tmp_path / "train.txt", 200)
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n{"body": "no text"}\n')
    file_tok = f"file:{tmp_path / 'tokenizer.json'}"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = [
        (["--text", prose], "--text needs a tokenizer, and the model file defines no tokenizer()", "--tokenizer"),
        (["--text", prose, "--tokenizer", f"file:{tmp_path / 'big.json'}"],
         "vocabulary of 202 ids is larger than the model's embedding of 128 rows", "use the tokenizer"),
        (["--text", str(tmp_path / "missing.txt"), "--tokenizer", file_tok], "cannot be read", "UTF-8 text"),
        (["--text", prose, "--tokenizer", "no-such-org/no-such-tokenizer"], "there is no network",
         "--tokenizer ./tokenizer"),
        (["--text", str(short), "--tokenizer", file_tok],
         "7 tokens, fewer than one global batch of 2 samples x 16 tokens + 1 target = 33", "more text"),
        (["--text", str(bad), "--tokenizer", file_tok], f"{bad} line 2: no \"text\" string", "a \"text\" field"),
        (["--data", prose, "--eval-text", prose], "--eval-text needs a tokenizer", "--tokenizer"),
    ]
    for argv, message, hint in cases:
        assert _preflight(plan, *argv) == 2, argv
        err = capfd.readouterr().err
        said, _, fix = err.partition("\n  hint: ")
        assert message in said and hint in fix and "Traceback" not in err, (argv, err)
    # refused before tokenizing, but for the short text (its tokens are right; their count is refused)
    assert [os.path.basename(p).split(".")[0] for p in glob.glob(f"{tmp_path}/*.u16")] == ["short"]
    with pytest.raises(SystemExit) as exit_:
        _preflight(plan, "--text", prose, "--data", prose)
    assert exit_.value.code == 2 and "not allowed with argument" in capfd.readouterr().err


def test_an_interrupted_tokenization_leaves_nothing_a_later_run_trusts(tmp_path, plan, monkeypatch):
    """Ctrl-C in the middle: no token file and no temporary one; a partial temporary file
    (a killed run's) is never read: the next run writes the whole file afresh."""
    tok = _word_tokenizer(tmp_path / "tokenizer.json")
    prose = _prose(tmp_path / "train.txt", 400)
    spec = f"file:{tmp_path / 'tokenizer.json'}"
    monkeypatch.setattr(text, "CHUNK_BYTES", 200)
    real = text._write
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(text, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _preflight(plan, "--text", prose, "--tokenizer", spec)
    assert glob.glob(f"{prose}.*") == []
    monkeypatch.setattr(text, "_write", real)
    name = text.cache_path([prose], text.load_tokenizer(spec, None), "uint16")
    with open(f"{name}.tmp-12345", "wb") as f:  # a killed run's half file
        f.write(np.arange(20, dtype=np.uint16).tobytes())
    assert _preflight(plan, "--text", prose, "--tokenizer", spec) == 0
    want = _document_ids(tok, prose)
    assert np.fromfile(name, dtype=np.uint16).tolist() == want


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_from_text_equals_training_from_its_token_file(tmp_path):
    """FSDP dp 2: --text (rank 0 tokenizes, rank 1 waits) with --eval-text trains with the
    same losses and held-out loss as --data / --eval-data on the same ids."""
    from dist_utils import run_world
    from train_worlds import main_world

    plan = write_plan(str(tmp_path / "dp2.json"), dp=2, zero=3, micro_batch_size=2)
    _word_tokenizer(tmp_path / "tokenizer.json")
    train, held = _prose(tmp_path / "train.txt", 1200, seed=1), _prose(tmp_path / "held.txt", 300, seed=2)
    common = ["--steps", "3", "--lr", "1e-2", "--quiet", "--no-plot", "--eval-batches", "2"]
    runs = {}
    for name, data in (("text", ["--text", train, "--eval-text", held, "--tokenizer",
                                 f"file:{tmp_path / 'tokenizer.json'}"]),
                       ("data", None)):
        if data is None:  # the token files the text run made, as --data
            data = ["--data", _cache(train), "--eval-data", _cache(held)]
        out = tmp_path / name
        argv = data + common + ["--losses-out", f"{out}.json", "--metrics", f"{out}.jsonl"]
        assert run_world(main_world, 2, GPT_TINY, plan, argv, timeout=250) == [0, 0]
        rows = [json.loads(line) for line in open(f"{out}.jsonl")]
        runs[name] = (json.loads(open(f"{out}.json").read()), [r.get("eval_loss") for r in rows])
    assert runs["text"] == runs["data"]
    eval_loss = runs["text"][1][-1]
    assert eval_loss is not None and math.isfinite(eval_loss)
