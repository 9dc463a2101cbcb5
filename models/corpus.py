"""The bundled model's corpus: the running interpreter's standard library source plus its pydoc topics.

Nothing is downloaded: every machine with CPython has both. Two kinds of document:

- ``code``: every ``Lib/**/*.py`` file of the running interpreter (code, docstrings and comments), read as
  bytes, except three folders: ``site-packages`` (not the standard library), ``pydoc_data`` (its one big
  file is the topics dict below, as a Python literal) and ``encodings`` (generated codec tables: hex
  rows, not Python anyone writes). Named ``Lib/<relative path>``.
- ``topic``: the ``help()`` topic texts of ``pydoc_data.topics.topics``, one document per topic, named
  ``topics/<key>``, UTF-8 encoded.

Exact duplicates (same bytes) are dropped, keeping the first name in sorted order.

The held-out split is **by document**: a whole file (or a whole topic) is held out when the sha256 of its
name, read as an integer, is divisible by ``HELDOUT_EVERY[kind]``. Held-out modules are never seen in training,
not even in part, and the split does not move when other files are added or removed.

The ``file list hash`` (``file_list_sha256``) is the sha256 of one line per document, ``name<TAB>sha256 of
its bytes``, in name order: two machines with the same hash train and evaluate on the same bytes.

Torch-free: validate and the tests read the held-out text through here.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HELDOUT_EVERY = {"code": 20, "topic": 5}  # about 1 file in 20 and 1 topic in 5 are held out (~1 MB, ~90 KB)
EXCLUDED = ("site-packages", "pydoc_data", "encodings")  # folders of Lib/ left out (see the module docstring)
SEPARATOR = b"\n\n"  # between documents when they are joined into one byte string


@dataclass(frozen=True)
class Document:
    name: str  # "Lib/json/decoder.py" or "topics/assert"
    kind: str  # "code" or "topic"
    text: bytes

    @property
    def heldout(self) -> bool:
        return is_heldout(self.name, self.kind)


def is_heldout(name: str, kind: str) -> bool:
    """Whether the document called ``name`` is in the held-out split (a fixed function of the name)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest(), "big") % HELDOUT_EVERY[kind] == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code_documents(root: Path) -> list[Document]:
    docs = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in EXCLUDED or any(part == "site-packages" for part in rel.parts):
            continue
        docs.append(Document("Lib/" + rel.as_posix(), "code", path.read_bytes()))
    return docs


def _topic_documents() -> list[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped-down Python without pydoc_data
        return []
    return [Document(f"topics/{key}", "topic", topics[key].encode("utf-8")) for key in topics]


@lru_cache(maxsize=1)
def documents() -> tuple[Document, ...]:
    """Every document of the corpus, in name order, exact duplicates dropped (the first name is kept)."""
    seen, out = set(), []
    for doc in sorted(_code_documents(stdlib_root()) + _topic_documents(), key=lambda d: d.name):
        digest = hashlib.sha256(doc.text).digest()
        if digest in seen or not doc.text:
            continue
        seen.add(digest)
        out.append(doc)
    return tuple(out)


def select(*, heldout: bool, kind: str | None = None) -> list[Document]:
    """The documents of one split (and, given ``kind``, one kind), in name order."""
    return [d for d in documents() if d.heldout == heldout and (kind is None or d.kind == kind)]


def join(docs) -> bytes:
    """Documents as one byte string, each followed by ``SEPARATOR``."""
    return b"".join(d.text + SEPARATOR for d in docs)


def file_list_sha256(docs=None) -> str:
    docs = documents() if docs is None else docs
    lines = "".join(f"{d.name}\t{hashlib.sha256(d.text).hexdigest()}\n" for d in docs)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def heldout_text(kind: str = "code") -> bytes:
    """The held-out documents of one kind joined (validate's held-out text is the code)."""
    return join(select(heldout=True, kind=kind))
