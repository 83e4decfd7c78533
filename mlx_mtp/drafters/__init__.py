"""Drafters: one per family, behind the protocol in ``base``."""
