"""Status codes of the decoding kernels: one number per meaning, shared by every kernel.

What it is: ``Status`` (named codes with stable numbers; 0 is success), ``MESSAGES``
(the one wording of each code, used by every decoder, CPU and GPU), and
``cuda_prologue``, the ``#define ERR_<NAME> <number>`` lines that every CUDA build is
compiled with, so that the kernels name the codes rather than repeat their numbers.
The Numba kernels take their ``ERR_<NAME>`` constants from here too.
What it is not: an exception (``CorruptDataError`` carries a code as ``.status``).
"""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    """What a kernel found in a chunk. Numbers never change: new codes take new ones."""

    OK = 0
    STATE = 1  # a lane's start state is below the coder's lower bound
    TRUNCATED = 2  # the payload ends before the last symbol
    TRAILING = 3  # the payload has words after the last symbol
    FINAL = 4  # a lane did not end in the encoder's initial state
    ODD = 5  # the payload is not the start states plus whole 16-bit words
    CONTEXT = 6  # context symbols do not match the chunk or the frame's tables
    BOUNDS = 7  # a chunk's symbols lie outside the output
    TABLE = 8  # a decode table does not have 2**precision slots
    CRC = 9  # the CRC-32 of the decoded values does not match
    RAW = 10  # a raw payload's length differs from the chunk's values
    PARAM = 11  # an invalid (mu, sigma) among the chunk's values
    EMPTY = 12  # tANS: a payload is empty or outside the frame
    MARKER = 13  # tANS: a payload's first byte has no start marker bit
    PLACE = 14  # a field payload fails its position CRC
    HEADER = 15  # a frame's or payload's header is invalid or declares another count
    MODEL = 16  # a frame's tables or a payload's class maps are invalid or truncated
    DIRECTORY = 17  # a chunk directory does not fit, or its payloads do not end the frame


# The codes as plain ints, the form Numba kernels take as compile-time constants.
OK = int(Status.OK)
ERR_STATE = int(Status.STATE)
ERR_TRUNCATED = int(Status.TRUNCATED)
ERR_TRAILING = int(Status.TRAILING)
ERR_FINAL = int(Status.FINAL)
ERR_ODD = int(Status.ODD)
ERR_CONTEXT = int(Status.CONTEXT)
ERR_BOUNDS = int(Status.BOUNDS)
ERR_TABLE = int(Status.TABLE)
ERR_CRC = int(Status.CRC)
ERR_RAW = int(Status.RAW)
ERR_PARAM = int(Status.PARAM)
ERR_EMPTY = int(Status.EMPTY)
ERR_MARKER = int(Status.MARKER)


MESSAGES: dict[Status, str] = {
    Status.STATE: "a lane's start state is below 2**16",
    Status.TRUNCATED: "payload ends before the last symbol",
    Status.TRAILING: "payload has data after the last symbol",
    Status.FINAL: "a lane did not end at 0 (tANS) or 2**16 (rANS), where the encoder "
                  "started (corrupt payload, or tables, model or parameters not the encoder's)",
    Status.ODD: "payload is not 128 state bytes plus whole 16-bit words",
    Status.CONTEXT: "context does not match the chunk's symbols or the frame's tables",
    Status.BOUNDS: "chunk's symbols lie outside the output array",
    Status.TABLE: "decode table does not have 2**precision slots",
    Status.CRC: "CRC-32 of decoded values does not match",
    Status.RAW: "raw payload length differs from the chunk's values",
    Status.PARAM: "invalid (mu, sigma) among the chunk's values",
    Status.EMPTY: "payload is empty or outside the frame",
    Status.MARKER: "payload's first byte is 0 (no start marker bit)",
    Status.PLACE: "field payload fails its position CRC-32",
    Status.HEADER: "frame or payload header is invalid",
    Status.MODEL: "frame tables or class maps are invalid",
    Status.DIRECTORY: "chunk directory does not match the frame",
}


def messages(*codes: Status) -> dict[Status, str]:
    """``MESSAGES`` restricted to ``codes``: the words of the codes one kernel reports."""
    return {c: MESSAGES[c] for c in codes}


def by_status(messages: dict[int, str]) -> dict[Status, str]:
    """A kernel's messages keyed by ``Status`` (``ValueError`` for a code that is none)."""
    return {Status(code): text for code, text in messages.items()}


def cuda_prologue() -> str:
    """``#define ERR_<NAME> <number>`` for every code but OK, for CUDA sources."""
    return "".join(f"#define ERR_{s.name} {s.value}\n" for s in Status if s)


__all__ = ["MESSAGES", "OK", "Status", "by_status", "cuda_prologue", "messages"]
