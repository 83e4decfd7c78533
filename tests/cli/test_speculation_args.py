"""``add_speculation_args``: ``mlx_mtp.generate`` and ``mlx_mtp.server`` declare the same
speculation and drafter flags (names, types, choices, defaults, help), list them in ``--help``,
and ``speculation_options`` turns them into the options the library takes."""

import importlib

import pytest

from mlx_mtp import cli
from mlx_mtp.decoding.speculation import SpeculationOptions
from mlx_mtp.errors import MTPError
from mlx_mtp.models.options import DraftOptions
from mlx_mtp.server.__main__ import build_parser as server_parser

generate_cli = importlib.import_module("mlx_mtp.generate")  # the module (generate is also the function)

FLAGS = ["--block-size", "--max-block-size", "--draft-topk", "--draft-tokens", "--acceptance",
         "--draft-vocab", "--draft-bits", "--draft-group-size", "--draft-quantize-fc",
         "--draft-bf16"]
DEFAULTS = {"block_size": "auto", "max_block_size": 6, "draft_topk": 1, "draft_tokens": None,
            "acceptance": "auto", "draft_vocab": None, "draft_bits": None,
            "draft_group_size": 64, "draft_quantize_fc": False, "draft_bf16": False}
PARSERS = {"generate": generate_cli.build_parser, "server": server_parser}


def speculation_actions(parser):
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings
            and a.option_strings[0] in FLAGS}


def test_both_clis_declare_the_same_flags():
    gen, srv = (speculation_actions(make()) for make in PARSERS.values())
    assert sorted(gen) == sorted(srv) == sorted(FLAGS)
    for flag in FLAGS:
        a, b = gen[flag], srv[flag]
        assert (a.dest, a.type, a.choices, a.default, a.nargs, a.const, a.help) == (
            b.dest, b.type, b.choices, b.default, b.nargs, b.const, b.help), flag


@pytest.mark.parametrize("name", PARSERS)
def test_defaults_are_the_librarys(name):
    args = PARSERS[name]().parse_args([])
    assert {k: getattr(args, k) for k in DEFAULTS} == DEFAULTS
    assert cli.speculation_options(args) == (SpeculationOptions(), DraftOptions())


@pytest.mark.parametrize("name", PARSERS)
def test_help_lists_every_flag(name, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[name]().parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in out, flag


@pytest.mark.parametrize("name", PARSERS)
def test_flags_become_the_options(name, tmp_path):
    args = PARSERS[name]().parse_args([
        "--block-size", "3", "--draft-topk", "2", "--draft-tokens", "3", "--acceptance",
        "point-mass", "--draft-vocab", str(tmp_path), "--draft-bits", "8", "--draft-group-size",
        "32", "--draft-quantize-fc"])
    speculation, draft = cli.speculation_options(args)
    assert speculation == SpeculationOptions(block_size=3, draft_topk=2, draft_tokens=3,
                                             acceptance="point-mass")
    assert draft == DraftOptions(vocab=str(tmp_path), bits=8, group_size=32, quantize_fc=True)
    args = PARSERS[name]().parse_args(["--block-size", "auto", "--max-block-size", "4",
                                       "--draft-bf16"])
    assert cli.speculation_options(args) == (SpeculationOptions(max_block_size=4),
                                             DraftOptions(bf16=True))


@pytest.mark.parametrize("argv,msg", [
    (["--draft-topk", "2", "--draft-tokens", "3"],
     "--draft-tokens must be an integer from the tree's depth (--block-size less one: 5) to 15, "
     "got 3"),
    (["--draft-bf16", "--draft-bits", "8"],
     "bf16=True (--draft-bf16) and --draft-bits both set the head's weights: pick one"),
])
@pytest.mark.parametrize("name", PARSERS)
def test_a_bad_combination_names_the_flags(name, argv, msg):
    with pytest.raises(MTPError) as e:
        cli.speculation_options(PARSERS[name]().parse_args(argv))
    assert str(e.value) == msg
