"""What the tests share: tiny checkpoints with the real file layouts (``tiny_checkpoints``,
``tiny_gemma4``, ``tiny_fp8``), mlx-lm's greedy reference (``reference``), fresh interpreters
(``processes``), drafters that force acceptance (``oracle``), verifies perturbed on purpose
(``perturbed``), the statistics of the sampling tests (``chisquare``) and the checks of the C
kernels and BLAS bindings (``native_support``). pyproject.toml's ``pythonpath`` puts ``tests/`` on
``sys.path``: import them as ``from support import tiny_checkpoints as tc``."""
