"""mlx_mtp: exact multi-token-prediction speculative decoding on MLX / mlx-lm.

A drop-in for mlx-lm: ``load``, ``generate``, ``stream_generate``, ``generate_step`` (pairs),
``speculative_generate_step`` (triples with ``from_draft``) and the prompt cache functions take
mlx-lm's arguments (plus ours: ``block_size``, ``drafter``, ...).
"""

# Before anything imports mlx.core: bind MLX's CPU matmuls to a fast system BLAS (Linux).
from . import cpu_blas

cpu_blas.load()

from .block_chooser import BlockChooser  # noqa: E402
from .errors import MTPError  # noqa: E402
from .loading import load, load_model  # noqa: E402
from .prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402
from .sampling import make_sampler  # noqa: E402
from .speculative import generate_step, speculative_generate_step  # noqa: E402
from .stream import generate, stream_generate  # noqa: E402

# ``generate`` is mlx-lm's function; importing the CLI module ``mlx_mtp.generate`` rebinds the
# name to that module, which is callable with the same signature (see generate.py).

__version__ = "0.1.0"


def __getattr__(name):
    # mlx-lm's one top-level function with no MTP counterpart: say so instead of a bare miss.
    if name == "batch_generate":
        raise AttributeError("mlx_mtp has no batch_generate: a speculative round decodes one "
                             "sequence at a time; use mlx_lm.batch_generate (no MTP)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["BlockChooser", "MTPError", "load", "load_model", "generate", "generate_step",
           "speculative_generate_step", "stream_generate", "make_sampler", "make_prompt_cache",
           "save_prompt_cache", "load_prompt_cache",
           "__version__"]
