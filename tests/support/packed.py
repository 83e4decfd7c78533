"""A packed verify of several sequences against each sequence's verify alone (any family)."""

import mlx.core as mx

from mlx_mtp.exactness.row_exact_layers import bitwise_equal


def assert_packed_verify_equals_alone(target, prompts, blocks, label) -> None:
    """Each sequence prefilled with ``prompts[s]``, then ``blocks[s]`` verified alone and, from
    another prefill, all blocks in one ``verify_batch``: every sequence's logits rows are equal,
    and so are its caches after a rollback to the block's first row, bitwise."""
    def prefilled(prompt):
        cache = target.make_cache()
        target.hidden(mx.array(prompt)[None], cache)
        return cache

    alone = []
    for prompt, block in zip(prompts, blocks):
        cache = prefilled(prompt)
        logits = target.logits(target.verify(mx.array(block)[None], cache)[0])
        target.rollback(cache, len(block), 1)
        alone.append((logits, target.cache_state(cache)))
    caches = [prefilled(p) for p in prompts]
    hidden = target.verify_batch([mx.array(b) for b in blocks], caches)
    assert [h.shape[1] for h in hidden] == [len(b) for b in blocks]
    logits = target.logits(mx.concatenate(hidden, axis=1)[0])
    first = 0
    for s, (block, (ref, ref_state), cache) in enumerate(zip(blocks, alone, caches)):
        w = len(block)
        assert bitwise_equal(logits[first : first + w], ref), (label, s)
        first += w
        target.rollback(cache, w, 1)
        state = target.cache_state(cache)
        assert len(state) == len(ref_state)
        assert all(bitwise_equal(a, b) for a, b in zip(state, ref_state)), (label, s)
