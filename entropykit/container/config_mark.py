"""The mark of a compressed checkpoint directory's ``config.json``.

What it is: ``marked`` / ``unmarked``: a ``quantization_config`` entry naming
``quant_method: "entropykit"`` and holding the original ``config.json`` text, so that
transformers routes loading to entropykit's quantizer and decompression restores the file
byte for byte (docs/format.md, "Checkpoint directories"); ``mark_dir`` / ``unmark_dir``
apply them to a directory being written. What it is not: the quantizer (``entropykit.hf``)
or anything that imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

QUANT_METHOD = "entropykit"
CONFIG = "config.json"
MARK_VERSION = 1
_KEY = "quantization_config"
_ORIGINAL = "original_config"  # the original config.json text, for byte-exact restore


def marked(raw: bytes) -> bytes | None:
    """``config.json`` bytes with the entropykit mark added, or None when they cannot
    carry it (not a UTF-8 JSON object, or one that already has a quantization config)."""
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):  # not JSON we can mark
        return None
    if not isinstance(obj, dict) or _KEY in obj:
        return None
    obj[_KEY] = {"quant_method": QUANT_METHOD, "version": MARK_VERSION, _ORIGINAL: text}
    out = (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return out if unmarked(out) == raw else None


def unmarked(raw: bytes) -> bytes | None:
    """The original ``config.json`` bytes of a marked one; None if ``raw`` has no mark."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # not JSON we can mark
        return None
    q = obj.get(_KEY) if isinstance(obj, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return None
    if not isinstance(q.get(_ORIGINAL), str):
        return None
    return q[_ORIGINAL].encode("utf-8")


def mark_dir(src: Path, out: Path) -> None:
    """Mark ``out/config.json`` (copied from ``src``) as an entropykit checkpoint; left as
    it is when it cannot carry the mark."""
    del src
    cfg = out / CONFIG
    if cfg.is_file() and not cfg.is_symlink():  # a kept link: its target is copied as is
        new = marked(cfg.read_bytes())
        if new is not None:
            cfg.write_bytes(new)


def unmark_dir(src: Path, out: Path) -> None:
    """Restore the original ``out/config.json`` (copied from ``src``) if it is marked."""
    del src
    cfg = out / CONFIG
    if cfg.is_file() and not cfg.is_symlink():  # a kept link: its target is copied as is
        old = unmarked(cfg.read_bytes())
        if old is not None:
            cfg.write_bytes(old)
