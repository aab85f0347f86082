"""The audit's text: English prose and Python code that ship with the Python interpreter itself.

Prose is the Python Language Reference as `pydoc` carries it (`pydoc_data.topics`, one document per
help topic, grammar and code blocks removed so what remains is running English text); code is a fixed
list of pure-Python standard-library modules. Both are under the PSF License and are present wherever
Python is, so the audit needs no download. Train and test windows come from different documents, so
an attacker cannot score by memorising a passage it saw during training.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

SOURCE = "Python 3 standard library: pydoc_data.topics (Language Reference prose) and module sources"
LICENCE = "PSF License Agreement (Python Software Foundation)"

CODE_MODULES = (
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "code",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "dis",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "imaplib",
    "inspect",
    "ipaddress",
    "json.decoder",
    "json.encoder",
    "locale",
    "logging",
    "mailbox",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "quopri",
    "random",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "zipfile",
)


@dataclass(frozen=True)
class Document:
    name: str
    kind: str  # "prose" or "code"
    text: str

    @property
    def is_test(self) -> bool:
        """A stable one-in-five split by name, so the same documents are always held out."""
        return hashlib.sha256(self.name.encode()).digest()[0] % 5 == 0


@dataclass
class Corpus:
    """Token windows of a fixed length; train and test windows never share a document."""

    train: torch.Tensor  # (n_train, window) token ids
    test: torch.Tensor  # (n_test, window)
    train_kinds: list[str] = field(default_factory=list)
    test_kinds: list[str] = field(default_factory=list)
    train_docs: int = 0
    test_docs: int = 0

    def describe(self) -> dict:
        def share(kinds: list[str]) -> float:
            return kinds.count("prose") / len(kinds) if kinds else 0.0

        return {
            "source": SOURCE,
            "licence": LICENCE,
            "window": int(self.train.shape[1]),
            "train_positions": int(self.train.numel()),
            "test_positions": int(self.test.numel()),
            "train_documents": self.train_docs,
            "test_documents": self.test_docs,
            "train_prose_share": share(self.train_kinds),
            "test_prose_share": share(self.test_kinds),
        }


def _prose(text: str) -> str:
    """Keep running text: drop indented blocks (grammar, examples) and heading underlines, unwrap lines."""
    paragraphs, current = [], []
    for line in text.splitlines():
        if not line.strip() or line.startswith("   ") or re.fullmatch(r"[*=\-^~+]{3,}", line.strip()):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(line.strip())
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(p for p in paragraphs if len(p.split()) >= 6)


def documents() -> list[Document]:
    """Every document of the corpus, prose first, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [Document(f"topic:{name}", "prose", _prose(text)) for name, text in sorted(topics.items())]
    for module in CODE_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        docs.append(Document(f"module:{module}", "code", Path(spec.origin).read_text(encoding="utf-8")))
    return [d for d in docs if d.text]


Window = tuple[list[int], str]  # token ids, document kind


def _windows(doc: Document, tokenizer: PreTrainedTokenizerBase, window: int, per_doc: int) -> list[Window]:
    """Up to `per_doc` non-overlapping windows spread evenly over one document."""
    ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
    n = len(ids) // window
    picks = sorted({round(i * (n - 1) / max(per_doc - 1, 1)) for i in range(min(n, per_doc))})
    return [(ids[p * window : (p + 1) * window], doc.kind) for p in picks]


def _take(
    docs: list[Document],
    tokenizer: PreTrainedTokenizerBase,
    window: int,
    per_doc: int,
    positions: int,
    prose_share: float,
) -> list[Window]:
    """Windows for at least `positions` tokens, prose and code in the given proportion.

    Each kind is read round-robin over its documents (every document's first window, then every
    second one, ...) so many documents contribute before any contributes twice.
    """
    wanted = -(-positions // window)
    queues = {}
    for kind in ("prose", "code"):
        per = [_windows(d, tokenizer, window, per_doc) for d in docs if d.kind == kind]
        queues[kind] = [w[i] for i in range(per_doc) for w in per if i < len(w)]
    n_prose = min(round(wanted * prose_share), len(queues["prose"]))
    picked = queues["prose"][:n_prose] + queues["code"][: wanted - n_prose]
    if len(picked) < wanted:
        raise ValueError(f"the corpus has only {len(picked) * window} positions of the {positions} asked")
    return picked


def build_corpus(
    tokenizer: PreTrainedTokenizerBase,
    window: int = 128,
    train_positions: int = 12288,
    test_positions: int = 3072,
    prose_share: float = 0.67,
    per_doc: int = 8,
) -> Corpus:
    """Windows of real text split by document: at least the asked positions on each side."""
    docs = documents()
    train_docs = [d for d in docs if not d.is_test]
    test_docs = [d for d in docs if d.is_test]
    train = _take(train_docs, tokenizer, window, per_doc, train_positions, prose_share)
    test = _take(test_docs, tokenizer, window, per_doc, test_positions, prose_share)
    return Corpus(
        torch.tensor([ids for ids, _ in train]),
        torch.tensor([ids for ids, _ in test]),
        [kind for _, kind in train],
        [kind for _, kind in test],
        len(train_docs),
        len(test_docs),
    )
