"""Rebuilding the embedded demo pair (``mlx_mtp/demo_pair/``) from scratch, PyTorch on the CPU:
``corpus`` (tokenizer and token ids from this Python's standard library), ``train_target``,
``train_head`` (self-distillation on the frozen target), ``export`` (the raw Hugging Face
checkpoint, checked against mlx-lm and mlx_mtp). Run from the repository root, in that order:

    python -m tools.demo_pair.corpus --out WORK
    python -m tools.demo_pair.train_target --work WORK --steps 600
    python -m tools.demo_pair.train_head --work WORK --steps 320
    python -m tools.demo_pair.export --work WORK --out mlx_mtp/demo_pair

Needs the ``train`` extra (``pip install -e ".[train]"``); never imported by mlx_mtp.
"""
