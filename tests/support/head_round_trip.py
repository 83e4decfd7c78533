"""One round trip of the Qwen MTP head's drafter, for tests that compare two ways of running it
(compiled or not, fused or not, bf16 or not, through the row kernel or not)."""

from __future__ import annotations


def draft_accept_draft(drafter, hidden, prompt):
    """A drafter's ids over one round trip: prefill, six drafts, their entries trimmed, an accept
    hook of three rows, six drafts again: ``(first drafts, the hook's seed, second drafts)``."""
    drafter.prefill(hidden, prompt[1:])
    first = drafter.draft(6)
    for c in drafter.cache:
        c.trim(drafter.in_round)
    drafter.in_round = 0
    drafter.accept(hidden[:, :3], prompt[2:5])
    return first.tolist(), drafter.first_draft.tolist(), drafter.draft(6).tolist()
