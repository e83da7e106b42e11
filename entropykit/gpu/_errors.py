"""The exception for a GPU decode asked for where it cannot run. Nothing else lives here."""


class GpuUnavailableError(RuntimeError):
    """torch, CuPy or a CUDA device is missing for a GPU decode."""
