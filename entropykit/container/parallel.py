"""The container's name for the package's thread pool (``coding.parallel``); nothing else."""

from ..coding.parallel import ENV, default_threads, imap, resolve, run

__all__ = ["ENV", "default_threads", "imap", "resolve", "run"]
