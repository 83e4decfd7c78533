"""Every test in this folder checks a benchmark or tool script (``benchmarks/``, ``tools/``): each
carries the ``bench`` marker, so the default run leaves them out and ``-m bench`` runs them."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # marked before any hook selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.bench)
