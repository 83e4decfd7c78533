"""Where the lazy C kernels cannot build, the user is told once, on stderr, why and what to
install (the eager kernels give the same bytes, slower)."""

import logging

import pytest

from mlx_mtp.cpu import lazy_ops, native

pytestmark = pytest.mark.skipif(native.cpu_problem() is not None,
                                reason="the C kernels need x86-64 Linux with AVX2 and FMA")


def test_a_failed_build_is_one_warning_naming_what_to_install(monkeypatch, caplog):
    def no_nanobind():
        raise RuntimeError("nanobind is not installed (pip install 'mlx-mtp[lazy]')")

    monkeypatch.setattr(lazy_ops, "_nanobind_dir", no_nanobind)
    monkeypatch.setattr(lazy_ops, "_import", lambda path: None)  # no module of an earlier build
    monkeypatch.setattr(lazy_ops, "_STATE", lazy_ops._State())
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        assert lazy_ops.load() is None
        assert lazy_ops.load() is None  # tried once a process: no second line
    lines = [r.getMessage() for r in caplog.records if "C kernels run eagerly" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "nanobind is not installed" in lines[0]
    assert "pip install 'mlx-mtp[lazy]'" in lines[0]
    assert lazy_ops.mode().startswith("eager (cannot build or load lazy_ops.cpp: nanobind")
