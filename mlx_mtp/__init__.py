"""mlx_mtp: exact multi-token-prediction speculative decoding on MLX / mlx-lm."""

# Before anything imports mlx.core: bind MLX's CPU matmuls to a fast system BLAS (Linux).
from . import cpu_blas

cpu_blas.load()

from .block_chooser import BlockChooser  # noqa: E402
from .errors import MTPError  # noqa: E402
from .loading import load, load_model  # noqa: E402
from .sampling import make_sampler  # noqa: E402
from .speculative import generate_step  # noqa: E402
from .stream import stream_generate  # noqa: E402

__version__ = "0.1.0"

__all__ = ["BlockChooser", "MTPError", "load", "load_model", "generate_step", "stream_generate", "make_sampler",
           "__version__"]
