"""Gemma 4: target adapter, verify attention, rollback caches, the assistant drafter and its
loading."""
