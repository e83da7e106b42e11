"""The exception raised for malformed compressed data. Nothing else lives here."""

from __future__ import annotations


class CorruptDataError(ValueError):
    """Compressed input is truncated, corrupted or not what it claims to be.

    Raised by every decoder for any malformed input; the message says what was wrong and
    where (byte offset, chunk index). It is a ``ValueError`` so callers that already
    catch bad-input errors keep working. Where a decoding kernel found the fault in a
    chunk, ``status`` is its code (``entropykit._status.Status``), ``chunk`` the chunk's
    index in its frame and ``offset`` the byte where its payload starts; otherwise they
    are None.
    """

    def __init__(self, *args: object, status: int | None = None, chunk: int | None = None,
                 offset: int | None = None) -> None:
        super().__init__(*args)
        self.status = status
        self.chunk = chunk
        self.offset = offset
