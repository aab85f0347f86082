"""The audit's text: English prose and Python code that ship with Python, and text users send.

Prose is the Python Language Reference as `pydoc` carries it (`pydoc_data.topics`, one document per
help topic, grammar and code blocks removed so what remains is running English text); code is a fixed
list of pure-Python standard-library modules. Both are under the PSF License and are present wherever
Python is, so the audit needs no download. Chat conversations and messages with personal data are
generated from templates (`synthetic`). Train and test windows come from different documents, and a
test window that shares any `NGRAM`-token sequence with any training document is dropped, so an
attacker cannot score by memorising a passage it saw during training (help topics quote each other).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import random

import torch
from transformers import PreTrainedTokenizerBase

from splitllm.lab.data import synthetic

SOURCE = (
    "Python 3 standard library: pydoc_data.topics (Language Reference prose) and module sources; "
    "template-generated chat conversations and personal-data messages"
)
LICENCE = "PSF License Agreement (Python Software Foundation); generated text: no licence needed"
KINDS = ("prose", "code", "chat", "personal")
SHARES = {"prose": 0.45, "code": 0.25, "chat": 0.15, "personal": 0.15}  # of each side's windows
NGRAM = 13  # a test window sharing a sequence this long with a training document is dropped
SYNTHETIC_DOCS = (48, 16)  # generated documents per kind: training, test

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
    kind: str  # one of KINDS
    text: str
    test: bool  # held out: the attacks never train on it


def _is_test(name: str) -> bool:
    """A stable one-in-five split by name, so the same documents are always held out."""
    return hashlib.sha256(name.encode()).digest()[0] % 5 == 0


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.to(torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class Corpus:
    """Token windows of a fixed length; train and test windows never share a document or an n-gram."""

    train: torch.Tensor  # (n_train, window) token ids
    test: torch.Tensor  # (n_test, window)
    long: torch.Tensor  # (n_long, long_window): whole long test contexts for the white-box search
    train_kinds: list[str] = field(default_factory=list)
    test_kinds: list[str] = field(default_factory=list)
    long_kinds: list[str] = field(default_factory=list)
    documents: dict[str, dict[str, int]] = field(default_factory=dict)  # side -> kind -> count
    dropped: int = 0  # test windows dropped for sharing an n-gram with the training documents
    considered: int = 0  # test windows before that

    def describe(self) -> dict:
        def shares(kinds: list[str]) -> dict[str, int]:
            return {k: kinds.count(k) for k in KINDS}

        return {
            "source": SOURCE,
            "licence": LICENCE,
            "window": int(self.train.shape[1]),
            "long_window": int(self.long.shape[1]) if self.long.numel() else 0,
            "train_positions": int(self.train.numel()),
            "test_positions": int(self.test.numel()),
            "long_positions": int(self.long.numel()),
            "documents": self.documents,
            "train_windows_by_kind": shares(self.train_kinds),
            "test_windows_by_kind": shares(self.test_kinds),
            "long_windows_by_kind": shares(self.long_kinds),
            "dedup": {"ngram": NGRAM, "test_windows_dropped": self.dropped, "test_windows_considered": self.considered},
            "sha256": {"train": _digest(self.train), "test": _digest(self.test), "long": _digest(self.long)},
        }

    def test_kind_mask(self, kind: str) -> torch.Tensor:
        """(n_test, window) True at the positions of test windows of this kind."""
        rows = torch.tensor([k == kind for k in self.test_kinds])
        return rows[:, None].expand_as(self.test)


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


def reference_documents() -> list[Document]:
    """The corpus' prose and code documents, in a fixed order: the part that needs no tokenizer."""
    from pydoc_data.topics import topics

    docs = [Document(f"topic:{n}", "prose", _prose(t), _is_test(f"topic:{n}")) for n, t in sorted(topics.items())]
    for module in CODE_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        text = Path(spec.origin).read_text(encoding="utf-8")
        docs.append(Document(f"module:{module}", "code", text, _is_test(f"module:{module}")))
    return [d for d in docs if d.text]


def documents(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> list[Document]:
    """Every document of the corpus in a fixed order: prose, code, then the generated kinds."""
    docs = reference_documents()
    for test, count in zip((False, True), SYNTHETIC_DOCS):
        rng = random.Random(f"{seed}-{test}")
        for i in range(count):
            chats = [synthetic.conversation(rng, test) for _ in range(3)]
            text = "".join(tokenizer.apply_chat_template(c, tokenize=False) for c in chats)
            docs.append(Document(f"chat:{int(test)}:{i}", "chat", text, test))
            docs.append(Document(f"personal:{int(test)}:{i}", "personal", synthetic.personal_text(rng, test), test))
    return [d for d in docs if d.text]


def _ngrams(ids: list[int], n: int = NGRAM) -> set[int]:
    return {hash(tuple(ids[i : i + n])) for i in range(len(ids) - n + 1)}


Window = tuple[list[int], str]  # token ids, document kind


def _windows(ids: list[int], kind: str, window: int, per_doc: int) -> list[Window]:
    """Up to `per_doc` non-overlapping windows spread evenly over one document's tokens."""
    n = len(ids) // window
    picks = sorted({round(i * (n - 1) / max(per_doc - 1, 1)) for i in range(min(n, per_doc))})
    return [(ids[p * window : (p + 1) * window], kind) for p in picks]


def _take(per_doc_windows: list[list[Window]], window: int, positions: int) -> list[Window]:
    """Windows for at least `positions` tokens, the kinds in the proportions of `SHARES`.

    Each kind is read round-robin over its documents (every document's first window, then every
    second one, ...) so many documents contribute before any contributes twice.
    """
    wanted = -(-positions // window)
    picked: list[Window] = []
    for kind in KINDS:
        per = [w for w in per_doc_windows if w and w[0][1] == kind]
        queue = [w[i] for i in range(max(map(len, per), default=0)) for w in per if i < len(w)]
        n = wanted - len(picked) if kind == KINDS[-1] else round(wanted * SHARES[kind])
        if len(queue) < n:
            raise ValueError(f"the corpus has only {len(queue)} {kind} windows of {window} tokens, {n} asked")
        picked += queue[:n]
    return picked


def build_corpus(
    tokenizer: PreTrainedTokenizerBase,
    window: int = 128,
    train_positions: int = 12288,
    test_positions: int = 3072,
    long_window: int = 0,
    long_windows: int = 0,
    per_doc: int = 8,
    seed: int = 0,
) -> Corpus:
    """Windows of real and generated text split by document: at least the asked positions per side,
    and `long_windows` whole contexts of `long_window` tokens from the longest test documents."""
    docs = documents(tokenizer, seed)
    ids = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
    seen: set[int] = set()
    for d, x in zip(docs, ids):
        if not d.test:
            seen |= _ngrams(x)

    def clean(w: Window) -> bool:
        return not (_ngrams(w[0]) & seen)

    train = _take([_windows(x, d.kind, window, per_doc) for d, x in zip(docs, ids) if not d.test], window,
                  train_positions)
    test_all = [_windows(x, d.kind, window, per_doc) for d, x in zip(docs, ids) if d.test]
    test_clean = [[w for w in ws if clean(w)] for ws in test_all]
    test = _take(test_clean, window, test_positions)
    long: list[Window] = []
    if long_windows:
        firsts = sorted(((x[:long_window], d.kind) for d, x in zip(docs, ids) if d.test and len(x) >= long_window),
                        key=lambda w: (w[1] != "prose", w[1]))
        long = [w for w in firsts if clean(w)][:long_windows]
        if len(long) < long_windows:
            raise ValueError(f"only {len(long)} clean test documents have {long_window} tokens, {long_windows} asked")
    counts: dict[str, dict[str, int]] = {"train": {}, "test": {}}
    for d in docs:
        side = counts["test" if d.test else "train"]
        side[d.kind] = side.get(d.kind, 0) + 1
    return Corpus(
        torch.tensor([w for w, _ in train]),
        torch.tensor([w for w, _ in test]),
        torch.tensor([w for w, _ in long]) if long else torch.empty(0, 0, dtype=torch.long),
        [k for _, k in train],
        [k for _, k in test],
        [k for _, k in long],
        counts,
        sum(map(len, test_all)) - sum(map(len, test_clean)),
        sum(map(len, test_all)),
    )
