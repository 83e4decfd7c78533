"""mlx_mtp: exact multi-token-prediction speculative decoding on MLX / mlx-lm.

A drop-in for mlx-lm: ``load``, ``generate``, ``stream_generate``, ``generate_step`` (pairs),
``speculative_generate_step`` (triples with ``from_draft``) and the prompt cache functions take
mlx-lm's arguments (plus ours: ``block_size``, ``drafter``, ...).
"""

import warnings

# Before anything imports mlx.core: bind MLX's CPU matmuls to a fast system BLAS (Linux).
from mlx_mtp.cpu import blas as cpu_blas

cpu_blas.load()

# As in mlx-lm, ``mlx_mtp.generate`` is the function and ``python -m mlx_mtp.generate`` the CLI
# module the package has already imported: runpy's warning about that says nothing to a user.
warnings.filterwarnings("ignore", category=RuntimeWarning,
                        message=r"'mlx_mtp\.generate' found in sys\.modules")

from mlx_mtp.decoding.block_chooser import BlockChooser  # noqa: E402
from mlx_mtp.demo import DEMO_DECODE  # noqa: E402
from mlx_mtp.errors import MTPError  # noqa: E402
from mlx_mtp.models.loader import load, load_model  # noqa: E402
from mlx_mtp.decoding.prompt_cache import (load_prompt_cache, make_prompt_cache,  # noqa: E402
                                           save_prompt_cache)
from mlx_mtp.decoding.sampling import make_sampler  # noqa: E402
from mlx_mtp.generate import (generate, generate_step, speculative_generate_step,  # noqa: E402
                              stream_generate)
from mlx_mtp.batch_generate import batch_generate  # noqa: E402


__version__ = "0.1.0"

__all__ = ["BlockChooser", "DEMO_DECODE", "MTPError", "load", "load_model", "generate", "generate_step", "batch_generate",
           "speculative_generate_step", "stream_generate", "make_sampler", "make_prompt_cache",
           "save_prompt_cache", "load_prompt_cache",
           "__version__"]
