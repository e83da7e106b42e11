"""The compressed safetensors container (docs/format.md, "Container").

A compressed file is itself a valid safetensors file: one U8 tensor per original tensor,
under the same name, holding that tensor's coded fields; ``__metadata__`` keeps the input's
own metadata and adds the entropykit record (how each tensor was coded, and the original
header for a byte-exact restore).

Modules, in data-flow order: ``header`` (safetensors headers), ``segment`` (format split
and field coding of one segment), ``codecs`` (rANS / tANS / zstd / raw per field),
``payload`` (one tensor's payload), ``record`` (the metadata record), ``writer`` and
``reader`` (whole files, streaming), ``files`` (paths, atomic output), ``checkpoint``
(sharded directories), with ``source`` (files read on demand, never mapped), ``parallel``,
``stats`` and ``_atomic`` as helpers.
"""

from .files import compress_file, decompress_file, default_output, verify_file
from .reader import Compressed
from .stats import Row, Summary

__all__ = ["Compressed", "Row", "Summary", "compress_file", "decompress_file",
           "default_output", "verify_file"]
