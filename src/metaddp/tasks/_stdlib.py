"""A text corpus present on every machine: the Python standard library's own source files.

The documents are the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``, in
order of their names, read as bytes (byte-level tokens, 256 of them). A file is held out (the
"test" split) when the CRC-32 of its name is divisible by :data:`TEST_EVERY`: a rule on the
name alone, so the split is the same on every machine with the same files, and a file never
moves when others are added. Files shorter than a task's window are left out by the family
that draws the windows. The text, and so every number measured on it, depends on the
Python version's standard library (3.11 where this project's numbers were measured).
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
import zlib
from pathlib import Path

TEST_EVERY = 5  # about one file in five is held out


def held_out(name: str) -> bool:
    """Whether the file ``name`` (its name, not its path) belongs to the test split."""
    return zlib.crc32(name.encode()) % TEST_EVERY == 0


def root() -> Path:
    """The standard library's folder on this machine."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def documents(split: str) -> tuple[tuple[str, bytes], ...]:
    """The ``(name, bytes)`` of every document of ``split`` ("train" or "test"), by name."""
    files = sorted(root().glob("*.py"), key=lambda p: p.name)
    want = split == "test"
    return tuple((p.name, p.read_bytes()) for p in files if held_out(p.name) == want)


def identity() -> str:
    """The corpus in a few words: the files per split and the first 12 hex digits of the
    SHA-256 of every file's name and bytes (another standard library gives another one)."""
    digest = hashlib.sha256()
    counts = []
    for split in ("train", "test"):
        docs = documents(split)
        counts.append(f"{len(docs)} {split}")
        for name, text in docs:
            digest.update(name.encode() + b"\0" + hashlib.sha256(text).digest())
    return f"stdlib {', '.join(counts)} files, {digest.hexdigest()[:12]}"
