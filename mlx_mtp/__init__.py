"""mlx_mtp: exact multi-token-prediction speculative decoding on MLX / mlx-lm."""

from .errors import MTPError
from .loading import load, load_model
from .sampling import make_sampler
from .speculative import generate_step

__version__ = "0.1.0"

__all__ = ["MTPError", "load", "load_model", "generate_step", "stream_generate", "make_sampler",
           "__version__"]


def __getattr__(name):
    if name == "stream_generate":  # lazy: generate.py is also the CLI entry point
        from .generate import stream_generate

        return stream_generate
    raise AttributeError(name)
