"""What a user or contributor runs to measure mlx_mtp, from the repository root:
``python -m benchmarks.<name> ...`` (docs/benchmarks.md: the protocol, each benchmark, the records).

Shared by all of them: ``common`` (prompts, timing, the distinct-4-gram share, record flags,
setup and writing, finding records), ``idle`` (the idle check), ``plots`` (the records'
pictures), ``random_checkpoints`` (random-weight pairs; the tests build theirs with it too) and
``harness`` (starting ``mlx.launch`` ranks and ``mlx_mtp.server`` processes). Benchmarks and tools
may import each other's modules; nothing here imports ``tests/``.
"""
