"""The exception raised for malformed compressed data. Nothing else lives here."""


class CorruptDataError(ValueError):
    """Compressed input is truncated, corrupted or not what it claims to be.

    Raised by every decoder for any malformed input; the message says what was wrong and
    where (byte offset, chunk index). It is a ``ValueError`` so callers that already
    catch bad-input errors keep working.
    """
