"""Training from text (`train.py --text FILE [FILE ...]`, `--eval-text FILE`).

Text is tokenized once, by rank 0, into a token file beside the first text file,

    corpus.txt.<12 hex digits>.u16      (.u32 for a vocabulary over 65,536 ids)

named by a hash of the tokenizer (its own serialised form where it has one, and the
ids it gives a fixed probe sentence), the end-of-document id, the dtype and every
text file's path, size and mtime: another tokenizer or an edited text is another
name, so a cache is never read for text it was not made from. It is written under
a temporary name and renamed when complete, so an interrupted tokenization (Ctrl-C,
a killed job) leaves nothing a later run trusts. The other ranks wait for rank 0's
answer (the path, or its error) and then read the file as `--data` reads a token
file (`data.TokenFile`: data order, resume checks and vocabulary checks unchanged).

Documents: a `.jsonl` line's "text" field is one document, a plain UTF-8 file is one
document; each is followed by the tokenizer's end-of-document id when it has one
(as nanoGPT's and Megatron's preparation scripts join them), and no other special
token is added. A plain file is encoded in pieces of about 1 MB, each cut before a
line that starts with a non-blank character (a place where pre-tokenizers split
anyway).

Tokenizers (`--tokenizer SPEC`): `model` (the default when the model file defines
`tokenizer()`, returning an object with `encode(str) -> list[int]` and optionally
`eos_token_id` and `vocab_size`; a Hugging Face or `tokenizers` tokenizer returned
there is used as such), `file:tokenizer.json` (the `tokenizers` library), or a Hugging
Face tokenizer's folder or name (`transformers.AutoTokenizer`, imported only then).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse

import numpy as np
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.train.data import TOKEN_DTYPES

PROGRESS_EVERY_S = 5.0  # a progress line this often while tokenizing, terminal or not
CHUNK_BYTES = 1 << 20  # text handed to the tokenizer at once
CACHE_FORMAT = 1  # part of every cache's hash: a change of format makes new names
SUFFIXES = {"uint16": "u16", "uint32": "u32", "int32": "i32", "int64": "i64"}
ID_LIMITS = {name: int(np.iinfo(t).max) + 1 for name, t in TOKEN_DTYPES.items()}  # the token files' own dtypes
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
PROBE = "autopar probe: The quick brown fox, 12 345.67!\n\t Ünïcödé ß 中文 end"
TOKENIZER_HINT = ("pass --tokenizer FOLDER (a Hugging Face tokenizer saved with save_pretrained), --tokenizer "
                  "file:tokenizer.json, or define tokenizer() in the model file (an object with encode(str) -> "
                  "list[int])")


@dataclass
class TextTokenizer:
    """What tokenizing needs of any tokenizer, whichever library made it."""
    name: str  # as messages name it
    encode_batch: Callable[[list], list]  # texts -> their ids, no special tokens added
    eos_id: int | None  # appended after each document
    vocab_size: int | None  # ids are below it (None: not known)
    identity: str  # what the cache's name hashes besides the probe's ids


def prepare(args, loaded, token_seq: Callable[[str], int], global_batch: int, model_vocab: int | None) -> None:
    """--text / --eval-text -> token files: sets args.data / args.eval_data to them and
    args.data_dtype to their dtype. Rank 0 tokenizes (or finds the cache); every rank
    gets its answer, or raises its error. token_seq(flag): the sequence length samples
    are cut to (refused, naming the flag, for a model that does not read token ids)."""
    if not (args.text or args.eval_text):
        if args.tokenizer:
            raise AutoparError("--tokenizer is only used with --text / --eval-text",
                               hint="add --text FILE, or drop --tokenizer")
        return
    seq_len = token_seq("--text" if args.text else "--eval-text")
    _join_process_group(args)
    made = _on_rank_zero(lambda: _make_all(args, loaded, seq_len, global_batch, model_vocab))
    for flag, path in made["files"].items():
        if not os.path.isfile(path):  # rank 0's file system is not this rank's
            message = (f"{flag}: rank 0 wrote the tokens to {path}, which this rank cannot see; put the text on a "
                       "file system every node shares, or run train.py --preflight on each node first")
            print(f"autopar: rank {dist.get_rank()}: {message}", file=sys.stderr, flush=True)
            raise AutoparError(message)
    args.data = made["files"].get("--text", args.data)
    args.eval_data = made["files"].get("--eval-text", args.eval_data)
    args.data_dtype = made["dtype"]


def _join_process_group(args) -> None:
    """The job's process group, joined now (autopar.compile would, later) so that ranks
    other than 0 can wait for its tokens; none in --preflight's single process."""
    if args.preflight or dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1") or 1) < 2:
        return
    from autopar.lower.mesh import init_distributed
    init_distributed()


def _on_rank_zero(make: Callable[[], dict]) -> dict:
    """make() on rank 0 only; its result or its AutoparError on every rank (a broadcast,
    so the others wait for it however long tokenizing takes within the group's timeout)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    answer = [None]
    if dist.get_rank() == 0:
        try:
            answer = [("ok", make())]
        except AutoparError as exc:
            answer = [("error", (exc.message, exc.hint))]
        except BaseException as exc:
            dist.broadcast_object_list([("error", (f"tokenizing failed on rank 0: {exc!r}", None))], src=0)
            raise
    dist.broadcast_object_list(answer, src=0)
    status, value = answer[0]
    if status == "error":
        raise AutoparError(value[0], hint=value[1])
    return value


def _make_all(args, loaded, seq_len: int, global_batch: int, model_vocab: int | None) -> dict:
    """Check the files, load the tokenizer, check it against the model, then make (or
    reuse) one token file per flag -> {"files": {flag: path}, "dtype": dtype}."""
    jobs = [(flag, paths) for flag, paths in (("--text", args.text),
                                              ("--eval-text", [args.eval_text] if args.eval_text else None))
            if paths]
    for flag, paths in jobs:
        _check_readable(flag, paths)
    tok = load_tokenizer(args.tokenizer, getattr(loaded, "tokenizer", None), jobs[0][0])
    check_vocabulary(tok, model_vocab)
    dtype = _dtype(args, tok, model_vocab)
    files = {}
    for flag, paths in jobs:
        path = cache_path(paths, tok, dtype)
        if os.path.isfile(path):
            count = os.path.getsize(path) // np.dtype(dtype).itemsize
            _say(f"{flag}: reusing {path} ({count:,} tokens, made before with {tok.name})")
        else:
            count = tokenize(flag, paths, tok, path, dtype, model_vocab)
        _check_count(flag, paths, count, seq_len, global_batch)
        files[flag] = path
    return {"files": files, "dtype": dtype}


def _say(line: str) -> None:
    print(f"autopar: {line}", file=sys.stderr, flush=True)


def _check_readable(flag: str, paths: list) -> None:
    for path in paths:
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise AutoparError(f"{flag} {path}: cannot be read ({exc.strerror or exc})",
                               hint="pass the path of a UTF-8 text file or a .jsonl file with a \"text\" field "
                                    "per line") from None


def check_vocabulary(tok: TextTokenizer, model_vocab: int | None) -> None:
    """A tokenizer with more ids than the model has embedding rows would give ids the
    embedding has no row for: refused before any text is read."""
    if model_vocab is None or tok.vocab_size is None or tok.vocab_size <= model_vocab:
        return
    raise AutoparError(f"--tokenizer {tok.name}: its vocabulary of {tok.vocab_size:,} ids is larger than the "
                       f"model's embedding of {model_vocab:,} rows (token ids would be out of range)",
                       hint="use the tokenizer the model was built for, or build the model with a vocabulary "
                            f"of at least {tok.vocab_size:,}")


def _dtype(args, tok: TextTokenizer, model_vocab: int | None) -> str:
    """uint16 when every id fits (vocabularies up to 65,536), else uint32; next to a
    token file (--data / --eval-data) the token files share --data-dtype."""
    top = max((v for v in (tok.vocab_size, model_vocab) if v is not None), default=None)
    if not (args.data or args.eval_data):
        return "uint16" if top is not None and top <= ID_LIMITS["uint16"] else "uint32"
    if top is not None and top > ID_LIMITS[args.data_dtype]:
        raise AutoparError(f"--data-dtype {args.data_dtype} cannot hold this tokenizer's ids (up to {top - 1:,}), "
                           "and the text's tokens share it with the token file beside them",
                           hint="pass --data-dtype uint32 (and a token file written as uint32)")
    return args.data_dtype


def cache_path(paths: list, tok: TextTokenizer, dtype: str) -> str:
    """The token file beside the first text file: its name hashes all that its content
    depends on (the tokenizer, the end-of-document id, the dtype, each file's path,
    size and mtime)."""
    files = [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths]
    key = json.dumps({"format": CACHE_FORMAT, "tokenizer": tok.identity, "probe": _probe(tok),
                      "eos": tok.eos_id, "dtype": dtype, "files": files}, sort_keys=True, default=str)
    return f"{paths[0]}.{hashlib.sha256(key.encode()).hexdigest()[:12]}.{SUFFIXES[dtype]}"


def _probe(tok: TextTokenizer):
    """The ids of a fixed sentence (or the error it raises: a vocabulary without an
    unknown token): what tells two tokenizers apart where nothing else does."""
    try:
        return [int(i) for i in tok.encode_batch([PROBE])[0]]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _check_count(flag: str, paths: list, count: int, seq_len: int, global_batch: int) -> None:
    need = global_batch * seq_len + 1
    if count < need:
        raise AutoparError(f"{flag} {' '.join(paths)}: {count:,} tokens, fewer than one global batch of "
                           f"{global_batch} samples x {seq_len} tokens + 1 target = {need:,}",
                           hint="give more text, or plan a smaller --batch-size or --seq-len")


# -- tokenizing --------------------------------------------------------------------------------------------------

def tokenize(flag: str, paths: list, tok: TextTokenizer, path: str, dtype: str, model_vocab: int | None) -> int:
    """Write the ids of `paths`' documents to `path` (through a temporary file renamed
    when complete; removed on any failure or Ctrl-C) -> the token count."""
    tmp = f"{path}.tmp-{os.getpid()}"
    progress = _Progress(flag, sum(os.path.getsize(p) for p in paths))
    _say(f"{flag}: tokenizing {progress.total / 1e6:.1f} MB with {tok.name} into {path}")
    bound = min(model_vocab or ID_LIMITS[dtype], ID_LIMITS[dtype])
    try:
        out = open(tmp, "wb")
    except OSError as exc:
        raise AutoparError(f"{flag}: cannot write the token file beside the text ({tmp}: {exc.strerror or exc})",
                           hint="make that folder writable, or copy the text into a writable folder") from None
    try:
        with out:
            for p in paths:
                for texts, ends, done in _batches(flag, p):
                    progress.tokens += _write(out, tok, texts, ends, dtype, bound, f"{flag} {p}")
                    progress.update(done)
                progress.next_file(p)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)  # only a complete file ever has the name a later run trusts
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            _say(f"{flag}: tokenizing interrupted; nothing was kept")
        _remove(tmp)
        raise
    _say(f"{flag}: {progress.tokens:,} tokens in {path} ({time.monotonic() - progress.start:.1f} s)")
    return progress.tokens


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _write(out, tok: TextTokenizer, texts: list, ends: list, dtype: str, bound: int, where: str) -> int:
    """Encode texts, append the end-of-document id after each that ends one, check
    every id against the model's vocabulary, append them to `out` -> how many."""
    flat = []
    for ids, end in zip(tok.encode_batch(texts), ends):
        flat.extend(ids)
        if end and tok.eos_id is not None:
            flat.append(tok.eos_id)
    ids = np.asarray(flat, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= bound)) if ids.size else ids
    if len(bad):
        raise AutoparError(f"{where}: {tok.name} gave token id {int(ids[bad[0]])}, outside the model's vocabulary "
                           f"of {bound:,}", hint="use the tokenizer the model was built for")
    ids.astype(dtype).tofile(out)
    return int(ids.size)


class _Progress:
    """One line every PROGRESS_EVERY_S seconds: MB done of the total, tokens so far."""

    def __init__(self, flag: str, total: int):
        self.flag, self.total, self.before, self.tokens = flag, total, 0, 0
        self.start = self.last = time.monotonic()

    def update(self, done_in_file: int) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        done = self.before + done_in_file
        rate = done / 1e6 / max(now - self.start, 1e-9)
        _say(f"{self.flag}: tokenized {done / 1e6:.1f} / {self.total / 1e6:.1f} MB "
             f"({100 * done / max(self.total, 1):.0f}%, {self.tokens:,} tokens, {rate:.1f} MB/s)")

    def next_file(self, path: str) -> None:
        self.before += os.path.getsize(path)


def _batches(flag: str, path: str):
    """(texts, whether each ends a document, bytes of the file read so far) in pieces
    of about CHUNK_BYTES: a .jsonl file's "text" fields, else the file's own text."""
    return _jsonl_batches(flag, path) if path.endswith(".jsonl") else _text_batches(flag, path)


def _text_batches(flag: str, path: str):
    """A plain file as one document, in pieces cut before a line that starts with a
    non-blank character once a piece holds CHUNK_BYTES."""
    lines, size, done = [], 0, 0
    with open(path, "rb") as f:
        for line in f:
            if size >= CHUNK_BYTES and not line[:1].isspace():
                yield [_decode(flag, path, lines, done - size)], [False], done
                lines, size = [], 0
            lines.append(line)
            size += len(line)
            done += len(line)
    if lines:
        yield [_decode(flag, path, lines, done - size)], [True], done


def _decode(flag: str, path: str, lines: list, offset: int) -> str:
    try:
        text = b"".join(lines).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AutoparError(f"{flag} {path}: not UTF-8 text (byte {offset + exc.start:,})",
                           hint=f"convert it first, e.g. iconv -f LATIN1 -t UTF-8 {path} > utf8.txt") from None
    return text[1:] if offset == 0 and text.startswith("\ufeff") else text  # a byte-order mark is no text


def _jsonl_batches(flag: str, path: str):
    """A .jsonl file: each line's "text" is one document; blank lines are skipped."""
    texts, size, done = [], 0, 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            done += len(line)
            if line.strip():
                texts.append(_jsonl_text(flag, path, number, line))
                size += len(line)
            if size >= CHUNK_BYTES or len(texts) >= 1024:
                yield texts, [True] * len(texts), done
                texts, size = [], 0
    if texts:
        yield texts, [True] * len(texts), done


def _jsonl_text(flag: str, path: str, number: int, line: bytes) -> str:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        record = exc
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    what = f"not JSON ({record})" if isinstance(record, Exception) else "no \"text\" string"
    raise AutoparError(f"{flag} {path} line {number}: {what}",
                       hint="each line of a .jsonl file is a JSON object with a \"text\" field, e.g. "
                            "{\"text\": \"...\"}; a plain text file needs another suffix than .jsonl")


# -- tokenizers --------------------------------------------------------------------------------------------------

def load_tokenizer(spec: str | None, model_tokenizer: Callable | None, flag: str = "--text") -> TextTokenizer:
    """--tokenizer SPEC: model (default when the model file defines tokenizer()),
    file:tokenizer.json, or a Hugging Face tokenizer's folder or name."""
    if spec in (None, "model"):
        if not callable(model_tokenizer):
            said = "--tokenizer model: the model file" if spec else f"{flag} needs a tokenizer, and the model file"
            raise AutoparError(f"{said} defines no tokenizer()", hint=TOKENIZER_HINT)
        return _from_model_file(model_tokenizer)
    if spec.startswith("file:"):
        return _from_tokenizer_json(spec[len("file:"):])
    return _from_hugging_face(spec)


def _from_model_file(make: Callable) -> TextTokenizer:
    try:
        obj = make()
    except Exception as exc:
        raise AutoparError(f"the model file's tokenizer() raised {type(exc).__name__}: {exc}") from None
    try:
        source = inspect.getsource(make)
    except (OSError, TypeError):
        source = getattr(make, "__qualname__", "tokenizer")
    return adapt(obj, "the model file's tokenizer()", source)


def adapt(obj, name: str, identity: str) -> TextTokenizer:
    """Any tokenizer object as a TextTokenizer: a Hugging Face tokenizer, a `tokenizers`
    Tokenizer, or an object with encode(str) -> list[int] (eos_token_id, vocab_size or
    n_vocab optional)."""
    kinds = {c.__name__ for c in type(obj).__mro__}
    if "PreTrainedTokenizerBase" in kinds:
        return _hugging_face_tokenizer(obj, name)
    if type(obj).__module__.startswith("tokenizers") and hasattr(obj, "encode_batch"):
        return _tokenizers_tokenizer(obj, name, None)
    if not callable(getattr(obj, "encode", None)):
        raise AutoparError(f"{name} returned {type(obj).__name__}, which has no encode(str) -> list[int]",
                           hint=TOKENIZER_HINT)
    vocab = next((v for v in (_number(obj, "vocab_size"), _number(obj, "n_vocab")) if v is not None), None)
    return TextTokenizer(name=name, encode_batch=lambda texts: [list(obj.encode(t)) for t in texts],
                         eos_id=next((v for v in (_number(obj, "eos_token_id"), _number(obj, "eot_token"))
                                      if v is not None), None), vocab_size=vocab,
                         identity=f"{type(obj).__module__}.{type(obj).__qualname__}\n{identity}")


def _number(obj, attr: str) -> int | None:
    value = getattr(obj, attr, None)
    value = value() if callable(value) else value
    return int(value) if isinstance(value, (int, np.integer)) else None


def _from_tokenizer_json(path: str) -> TextTokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise AutoparError("--tokenizer file:... needs the tokenizers library",
                           hint="pip install tokenizers") from None
    try:
        obj = Tokenizer.from_file(path)
    except Exception as exc:
        reason = "no such file" if not os.path.isfile(path) else f"{type(exc).__name__}: {exc}"
        raise AutoparError(f"--tokenizer file:{path}: cannot be loaded ({reason})",
                           hint="pass a tokenizer.json written by the tokenizers library (Tokenizer.save) or by "
                                "a Hugging Face tokenizer's save_pretrained") from None
    return _tokenizers_tokenizer(obj, f"file:{path}", _eos_beside(path))


def _eos_beside(path: str) -> str | None:
    """The eos_token a tokenizer_config.json beside a tokenizer.json names, if any."""
    try:
        with open(os.path.join(os.path.dirname(path), "tokenizer_config.json")) as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def _tokenizers_tokenizer(obj, name: str, eos_token: str | None) -> TextTokenizer:
    """A `tokenizers.Tokenizer`: its end-of-document id from eos_token, else the first
    special token with a usual end-of-text name."""
    special = {t.content: i for i, t in obj.get_added_tokens_decoder().items() if t.special}
    eos = special.get(eos_token) if eos_token else None
    if eos is None:
        eos = next((special[n] for n in EOS_NAMES if n in special), None)
    return TextTokenizer(name=name, eos_id=eos, vocab_size=obj.get_vocab_size(with_added_tokens=True),
                         encode_batch=lambda texts: [e.ids for e in obj.encode_batch(texts, add_special_tokens=False)],
                         identity=hashlib.sha256(obj.to_str().encode()).hexdigest())


def _hugging_face_tokenizer(obj, name: str) -> TextTokenizer:
    backend = getattr(obj, "backend_tokenizer", None)
    identity = hashlib.sha256(backend.to_str().encode()).hexdigest() if backend is not None else \
        f"{type(obj).__qualname__} {getattr(obj, 'name_or_path', '')} {sorted(obj.get_vocab().items())[:64]}"

    def encode_batch(texts):
        return obj(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]

    return TextTokenizer(name=name, encode_batch=encode_batch, eos_id=obj.eos_token_id, vocab_size=len(obj),
                         identity=identity)


def _from_hugging_face(spec: str) -> TextTokenizer:
    """A local folder, else a name in the Hugging Face cache, else a download when the
    hub can be reached at all (a cluster's compute node usually cannot)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise AutoparError(f"--tokenizer {spec} needs transformers",
                           hint="pip install transformers, or pass --tokenizer file:tokenizer.json") from None
    folder = os.path.isdir(spec)
    if not folder and spec.startswith((".", "/", "~")):
        raise AutoparError(f"--tokenizer {spec}: no such folder",
                           hint="pass a folder written by a tokenizer's save_pretrained(), or file:tokenizer.json")
    try:
        return _hugging_face_tokenizer(AutoTokenizer.from_pretrained(spec, local_files_only=True), spec)
    except Exception as exc:
        if folder:
            raise AutoparError(f"--tokenizer {spec}: a folder without a tokenizer transformers can load "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0]})",
                               hint="pass a folder written by a tokenizer's save_pretrained(), or "
                                    "file:FOLDER/tokenizer.json") from None
    return _hugging_face_tokenizer(_download(spec, AutoTokenizer), spec)


def _download(spec: str, auto_tokenizer):
    fetch = (f"on a machine with network: python3 -c \"from transformers import AutoTokenizer; "
             f"AutoTokenizer.from_pretrained('{spec}').save_pretrained('tokenizer')\", copy the folder here "
             "and pass --tokenizer ./tokenizer")
    endpoint = _hub_endpoint()
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or not _reachable(endpoint):
        raise AutoparError(f"--tokenizer {spec}: not a local folder nor in the Hugging Face cache, and there is no "
                           f"network to download it ({endpoint} cannot be reached, or HF_HUB_OFFLINE is set)",
                           hint=fetch)
    try:
        return auto_tokenizer.from_pretrained(spec)
    except Exception as exc:
        raise AutoparError(f"--tokenizer {spec}: not a local folder, nor in the Hugging Face cache, nor on the hub "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0]})",
                           hint=f"check the name, or {fetch}") from None


def _hub_endpoint() -> str:
    try:
        from huggingface_hub import constants
        return constants.ENDPOINT
    except Exception:  # an old or absent huggingface_hub: the public hub
        return "https://huggingface.co"


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub opens within `timeout` (the hub's own client
    retries an unreachable host for most of a minute)."""
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)),
                                      timeout=timeout):
            return True
    except OSError:
        return False
