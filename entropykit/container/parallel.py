"""The container's name for the package's thread pool (``coding.parallel``); nothing else."""

from ..coding.parallel import default_threads, imap, resolve, run

__all__ = ["default_threads", "imap", "resolve", "run"]
