"""Maintainers' tools, run from the repository root as ``python -m tools.<name>``: rebuilding the
demo pair (``tools.demo_pair``), record upkeep (``retake_records.sh``, ``pool_records``) and the
research tools that still answer a question a maintainer asks (each module's docstring says
which): ``acceptance_traces`` and ``simulate_chooser`` (the block chooser, replayed),
``draft_acceptance`` (the draft distribution at T > 0). Measuring is ``benchmarks/``'s job.
"""
