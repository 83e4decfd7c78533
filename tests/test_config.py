"""mlx_mtp.config: one table of every MLX_MTP_* variable, read only through its functions; a bad
value is a one-line MTPError that names the variable and what it must be."""

import ast
import re
from pathlib import Path

import pytest

import mlx_mtp
from mlx_mtp import MTPError, config

PACKAGE = Path(mlx_mtp.__file__).parent
NAME = re.compile(r"\bMLX_MTP_[A-Z0-9_]*[A-Z0-9]")


def source_files():
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".c", ".cpp", ".h", ".txt", ".md", ".json"):
            yield path


def test_every_name_the_package_mentions_is_in_the_table():
    mentioned = {}
    for path in source_files():
        for name in NAME.findall(path.read_text(errors="replace")):
            mentioned.setdefault(name, path.relative_to(PACKAGE).as_posix())
    table = {s.name for s in config.SETTINGS}
    missing = {n: where for n, where in mentioned.items() if n not in table}
    assert not missing, f"MLX_MTP_* names not in mlx_mtp.config.SETTINGS: {missing}"
    assert len(mentioned) >= 12


def test_the_table_has_no_duplicates_and_every_entry_is_complete():
    names = [s.name for s in config.SETTINGS]
    assert len(names) == len(set(names))
    for s in config.SETTINGS:
        assert s.name.startswith("MLX_MTP_")
        assert s.kind in (config.FLAG, config.COUNT, config.SECONDS, config.PATH, config.LIBRARY)
        assert s.accepts and s.help and "\n" not in s.help
        assert config.setting(s.name) is s
        assert config.value(s.name, {}) == s.default  # unset: the default
        assert config.value(s.name, {s.name: ""}) == s.default  # empty: the default


def test_a_name_outside_the_table_is_a_key_error():
    with pytest.raises(KeyError, match="MLX_MTP_NO_SUCH"):
        config.flag("MLX_MTP_NO_SUCH", {})


@pytest.mark.parametrize("name, value, expected", [
    ("MLX_MTP_SYNC_PHASES", "yes",
     "environment variable MLX_MTP_SYNC_PHASES must be 0 or 1, got 'yes'"),
    ("MLX_MTP_ROW_KERNEL", " on ",
     "environment variable MLX_MTP_ROW_KERNEL must be 0 or 1, got 'on'"),
    ("MLX_MTP_VERIFY_THREADS", "two", "environment variable MLX_MTP_VERIFY_THREADS must be a whole "
                                      "number of threads (0 = leave the BLAS default), got 'two'"),
    ("MLX_MTP_VERIFY_THREADS", "-1", "environment variable MLX_MTP_VERIFY_THREADS must be a whole "
                                     "number of threads (0 = leave the BLAS default), got '-1'"),
    ("MLX_MTP_DIST_TIMEOUT", "0",
     "MLX_MTP_DIST_TIMEOUT must be a positive number of seconds, got '0'"),
    ("MLX_MTP_DIST_TIMEOUT", "soon", "MLX_MTP_DIST_TIMEOUT must be a positive number of seconds, "
                                     "got 'soon'"),
])
def test_a_bad_value_is_a_one_line_error(monkeypatch, name, value, expected):
    with pytest.raises(MTPError) as e:
        config.value(name, {name: value})
    assert str(e.value) == expected
    monkeypatch.setenv(name, value)  # the process environment, read at call time
    with pytest.raises(MTPError) as e:
        config.value(name)
    assert str(e.value) == expected


def test_every_flag_refuses_a_bad_value():
    for s in config.SETTINGS:
        if s.kind == config.FLAG:
            with pytest.raises(MTPError, match=rf"^environment variable {s.name} must be 0 or 1, "
                                               r"got 'true'$"):
                config.flag(s.name, {s.name: "true"})


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("MLX_MTP_PIN_VERIFY", raising=False)
    assert config.flag("MLX_MTP_PIN_VERIFY") is True
    monkeypatch.setenv("MLX_MTP_PIN_VERIFY", "0")
    assert config.flag("MLX_MTP_PIN_VERIFY") is False
    monkeypatch.setenv("MLX_MTP_VERIFY_THREADS", " 3 ")
    assert config.count("MLX_MTP_VERIFY_THREADS") == 3 and config.is_set("MLX_MTP_VERIFY_THREADS")
    monkeypatch.setenv("MLX_MTP_DIST_TIMEOUT", "2.5")
    assert config.seconds("MLX_MTP_DIST_TIMEOUT") == 2.5
    monkeypatch.setenv("MLX_MTP_CACHE", "/tmp/x")
    assert config.path("MLX_MTP_CACHE") == "/tmp/x"
    monkeypatch.setenv("MLX_MTP_CPU_BLAS", " off ")
    assert config.text("MLX_MTP_CPU_BLAS") == "off"


def test_a_flag_keeps_an_explicit_default():
    assert config.flag("MLX_MTP_SYNC_PHASES", {}, default=True) is True
    assert config.flag("MLX_MTP_ROW_KERNEL", {}, default=False) is False
    assert config.flag("MLX_MTP_ROW_KERNEL", {"MLX_MTP_ROW_KERNEL": "1"}, default=False) is True


def _environ_reads(tree):
    """(line, argument) of each ``environ.get(x)``, ``environ[x]``, ``getenv(x)`` and
    ``x in environ`` in ``tree``."""
    def is_environ(node):
        if isinstance(node, ast.IfExp):  # (environ if environ is not None else os.environ)
            return is_environ(node.body) or is_environ(node.orelse)
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
            (isinstance(node, ast.Name) and node.id == "environ")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault")
                    and is_environ(f.value)) or \
                    (isinstance(f, ast.Attribute) and f.attr == "getenv"):
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.lineno, node.left


def test_no_module_but_config_reads_an_mlx_mtp_variable():
    strays = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "config.py":
            continue
        tree = ast.parse(path.read_text())
        constants = {t.id for node in tree.body if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                     and node.value.value.startswith("MLX_MTP_")
                     for t in node.targets if isinstance(t, ast.Name)}
        for line, arg in _environ_reads(tree):
            literal = isinstance(arg, ast.Constant) and str(arg.value).startswith("MLX_MTP_")
            named = (isinstance(arg, ast.Name) and arg.id in constants) or \
                (isinstance(arg, ast.Attribute) and "ENV" in arg.attr)
            if literal or named:
                strays.append(f"{path.relative_to(PACKAGE)}:{line}")
    assert not strays, f"MLX_MTP_* read outside mlx_mtp.config: {strays}"


def test_the_configuration_page_shows_the_table():
    """docs/configuration.md's table is ``config.markdown_table()`` (regenerate it from there)."""
    doc = (PACKAGE.parent / "docs" / "configuration.md").read_text()
    start = "<!-- Generated from mlx_mtp.config.SETTINGS: do not edit by hand. -->\n\n"
    end = "\n<!-- End of generated table. -->"
    assert start in doc and end in doc
    assert doc[doc.index(start) + len(start):doc.index(end)] == config.markdown_table()
