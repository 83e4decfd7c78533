"""The built-in model families: the one place that names them. A family is a package under
``mlx_mtp/models/`` whose ``__init__`` registers a ``mlx_mtp.models.families.Family``; adding one
is a new folder and a line here. The order is the order error lines list model types in."""

BUILTIN = (
    "mlx_mtp.models.qwen3_5",
    "mlx_mtp.models.gemma4",
)
