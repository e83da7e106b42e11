"""The container's name for the package's thread pool (``coding.parallel``); nothing else."""

from ..coding.parallel import ENV, UNIT_BYTES, default_threads, imap, imap_grouped, resolve, run

__all__ = ["ENV", "UNIT_BYTES", "default_threads", "imap", "imap_grouped", "resolve", "run"]
