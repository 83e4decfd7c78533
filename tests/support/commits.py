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
