"""mlx_mtp.models.families: each family registers itself; shared code finds it by model type or
name and imports no family module."""

import ast
from pathlib import Path

import pytest
from mlx_lm.models import cache as mlx_cache

import mlx_mtp
from mlx_mtp.models import families

PACKAGE = Path(mlx_mtp.__file__).parent
FAMILY_DIRS = [PACKAGE / "models" / m.rsplit(".", 1)[-1] for m in families.BUILTIN]
# Qwen-only command-line tools that still import the Qwen family directly.
KNOWN_CLI_IMPORTS = {"draft_vocab.py", "quantize_drafter.py"}


def test_the_built_in_families_in_list_order():
    assert [f.name for f in families.all_families()] == ["qwen3_5", "gemma4"]
    assert families.model_types() == ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma4_text",
                                      "gemma4", "gemma4_unified")
    assert families.for_model_type("qwen3_next").name == "qwen3_5"
    assert families.for_model_type("gemma4_unified").name == "gemma4"
    assert families.for_model_type("llama") is None
    assert families.by_name("gemma4").cache_classes[mlx_cache.RotatingKVCache].__name__ == \
        "RollbackRotatingKVCache"
    assert families.by_name("nope") is None


def test_a_model_type_is_one_familys():
    taken = families.Family(name="other", model_types=("llama", "qwen3_5"), load=lambda: None)
    with pytest.raises(ValueError, match="model_type 'qwen3_5' is already qwen3_5's"):
        families.register(taken)
    assert families.for_model_type("llama") is None


def _imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_no_shared_module_and_no_other_family_imports_a_family():
    family_modules = {m: d for m, d in zip(families.BUILTIN, FAMILY_DIRS)}
    strays = []
    for path in PACKAGE.rglob("*.py"):
        own = next((m for m, d in family_modules.items() if d in path.parents), None)
        if own is None and path.relative_to(PACKAGE).as_posix() in KNOWN_CLI_IMPORTS:
            continue
        for module in _imported_modules(path):
            for family in family_modules:
                if family != own and (module == family or module.startswith(family + ".")):
                    strays.append(f"{path.relative_to(PACKAGE)}: {module}")
    assert not strays, strays
