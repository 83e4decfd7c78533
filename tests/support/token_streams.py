"""Reading a generate_step-style generator, and comparing two lists of arrays bit for bit."""

import mlx.core as mx


def take(gen, n):
    """The first ``n`` token ids of a generate_step-style generator, then close it (what a caller
    that stops reading does)."""
    out = []
    for item in gen:
        out.append(item[0])
        if len(out) == n:
            break
    gen.close()
    return out


def bitwise(a, b) -> bool:
    """Two lists of arrays with the same shapes, dtypes and bytes."""
    mx.eval(a, b)
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and bytes(memoryview(x)) == bytes(memoryview(y))
        for x, y in zip(a, b))
