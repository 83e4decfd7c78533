"""Watching a target's commits: the cache a round's rollback (or a tree's ``keep_path``) left."""

from contextlib import contextmanager


@contextmanager
def committed(target, method: str = "rollback"):
    """``target.<method>`` wrapped for the body: yields a dict whose ``"cache"`` is the cache the
    latest call committed (absent before the first)."""
    seen = {}
    orig = getattr(target, method)

    def spy(cache, *args, **kwargs):
        orig(cache, *args, **kwargs)
        seen["cache"] = cache

    setattr(target, method, spy)
    try:
        yield seen
    finally:
        delattr(target, method)  # the class's method again


def drafter_fed(offset: int, prompt_len: int, max_tokens: int) -> bool:
    """Whether the round that committed the target's cache up to ``offset`` fed the drafter:
    every round does but those that leave at most one token of the budget (no later round
    drafts; ``mlx_mtp.decoding.round_steps.commit``). The cache holds every emitted token but
    the round's last, so ``offset - prompt_len + 1`` tokens are out."""
    return max_tokens - (offset - prompt_len + 1) > 1
