"""Rebuilding the embedded demo pair (``mlx_mtp/demo_pair/``) from scratch, PyTorch on the CPU:
``corpus`` (tokenizer and token ids from this Python's standard library, also cut at line ends),
``train_target`` (from scratch, then fine-tuned on the cut ids), ``demo_texts`` (the target's own
text under the demo's decode), ``train_head`` (self-distillation on the frozen target, checked by
``drafting_sim``), ``export`` (the raw Hugging Face checkpoint, checked against mlx-lm and
mlx_mtp; ``newline_check`` counts newline prompts that end the text). Run from the repository
root, in that order (docs/development.md gives the flags):

    python -m tools.demo_pair.corpus --out WORK
    python -m tools.demo_pair.train_target --work WORK --steps 600 --run base
    python -m tools.demo_pair.train_target --work WORK --init WORK/base/model.pt --data train_cut ...
    python -m tools.demo_pair.demo_texts --work WORK
    python -m tools.demo_pair.train_head --work WORK ...
    python -m tools.demo_pair.export --work WORK --out mlx_mtp/demo_pair

Needs the ``train`` extra (``pip install -e ".[train]"``); never imported by mlx_mtp.
"""
