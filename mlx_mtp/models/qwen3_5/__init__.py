"""Qwen3.5 / Qwen3.6 / Qwen3-Next: target adapter, MTP head and drafter, head loading, draft
vocabulary and head quantization."""
