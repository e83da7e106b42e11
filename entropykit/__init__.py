"""entropykit: lossless entropy coding of ML model weights and KV caches."""

from . import _jit  # noqa: F401  (first: it sets where the kernels defined below are cached)
from ._errors import CorruptDataError

__version__ = "0.1.0"
__all__ = ["CorruptDataError", "__version__"]

from .api import compress, compress_file, decompress, decompress_file, load_file, save_file
from .hf import install as _install_hf
from .lazy import safe_open

__all__ += ["compress", "compress_file", "decompress", "decompress_file", "load_file",
            "safe_open", "save_file"]

_install_hf()  # from_pretrained of compressed checkpoints, once transformers is imported
