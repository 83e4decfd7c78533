"""``convert`` and ``python -m mlx_mtp.convert``: one MLX folder with a (quantized) target, written
by mlx-lm's own steps so that mlx-lm alone loads it, and its MTP drafter beside it where the loader
looks (``OUT/mtp/`` for Qwen, ``OUT/assistant/`` for Gemma 4), so ``--model OUT`` needs no
``--drafter``. Written into a temporary folder, renamed into place only when complete.
docs/models.md, "python -m mlx_mtp.convert", says what each part holds."""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Iterable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm import utils as mlx_lm_utils
from tqdm import tqdm

from mlx_mtp.cli import Parser, cli_main, positive_int
from mlx_mtp.io import fp8
from mlx_mtp.io.checkpoint import (cast_floats, load_mlx_lm_model, read_config, resolve_path,
                         safetensors_header, weight_files)
from mlx_mtp.errors import MTPError
from mlx_mtp.models import families
from mlx_mtp.models.options import QUANT_BITS, QUANT_GROUP_SIZES

DTYPES = ("bfloat16", "float16", "float32")  # mlx_lm.convert's MODEL_CONVERSION_DTYPES


def _bar(desc: str, total: int, quiet: bool):
    return tqdm(total=total, desc=desc, unit="tensor", disable=quiet, leave=False)


def _drop_quantization_config(config: dict) -> None:
    """The FP8 block config no longer describes the dequantized weights."""
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)


def _conversion_dtype(dtype: Optional[str], config: dict) -> Optional[str]:
    """``mlx_lm.convert``'s rule: the flag, else config ``torch_dtype``, else text_config ``dtype``."""
    if dtype is None:
        dtype = config.get("torch_dtype", None)
    if dtype is None and (text := config.get("text_config", None)):
        dtype = text.get("dtype", None)
    return dtype if dtype in DTYPES else None


def save_target(dst: Path, src: Path, model, tokenizer, config: dict, quiet: bool) -> None:
    """mlx-lm's ``save`` (``save_model``'s shards and index, ``save_config``, tokenizer files,
    ``*.py`` and ``generation_config.json``, model card), each tensor evaluated under a progress
    bar before its shard is written; one shard in memory at a time, as in mlx-lm."""
    dst.mkdir(parents=True, exist_ok=True)
    keep_vision_config = "vision_tower" in getattr(model, "model", {})
    weights = dict(tree_flatten(model.parameters()))
    shards = mlx_lm_utils.make_shards(weights)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values()),
                          "total_parameters": mlx_lm_utils.get_total_parameters(model)},
             "weight_map": {}}
    model.update(tree_map_with_path(lambda _, v: mx.array([]), model.parameters()))  # donate
    weights.clear()
    bar = _bar("converting target", sum(len(s) for s in shards), quiet)
    for i in range(len(shards)):
        shard, shards[i] = shards[i], None
        for v in shard.values():
            mx.eval(v)
            bar.update()
        name = fmt.format(i + 1, len(shards))
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
        index["weight_map"].update({k: name for k in shard})
        del shard
    bar.close()
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    with open(dst / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    mlx_lm_utils.save_config(config, config_path=dst / "config.json",
                             keep_vision_config=keep_vision_config)
    tokenizer.save_pretrained(dst)
    for pattern in ["*.py", "generation_config.json"]:
        for f in glob.glob(str(src / pattern)):
            shutil.copy(f, dst)
    mlx_lm_utils.create_model_card(dst, None)


def _check_args(out: Path, q_bits, q_group_size, dtype, head_bits, head_group_size,
                draft_vocab, corpus) -> None:
    if out.exists():
        raise MTPError(f"--mlx-path {out} already exists: choose a new folder or delete it")
    if q_bits is not None and q_bits not in QUANT_BITS:
        raise MTPError(f"--q-bits must be one of {', '.join(map(str, QUANT_BITS))}, got {q_bits}")
    if q_group_size is not None and q_group_size not in QUANT_GROUP_SIZES:
        raise MTPError(f"--q-group-size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, "
                       f"got {q_group_size}")
    if dtype is not None and dtype not in DTYPES:
        raise MTPError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if head_bits is not None and head_bits not in QUANT_BITS:
        raise MTPError(f"--head-bits must be none or one of {', '.join(map(str, QUANT_BITS))}, "
                       f"got {head_bits}")
    if head_group_size not in QUANT_GROUP_SIZES:
        raise MTPError(f"--head-group-size must be one of "
                       f"{', '.join(map(str, QUANT_GROUP_SIZES))}, got {head_group_size}")
    if (draft_vocab is None) != (not corpus):
        raise MTPError("--draft-vocab N and --corpus FILES go together")


def convert(hf_path, mlx_path, *, quantize: bool = False, q_bits: Optional[int] = None,
            q_group_size: Optional[int] = None, dtype: Optional[str] = None, drafter=None,
            head_bits: Optional[int] = None, head_group_size: int = 64,
            draft_vocab: Optional[int] = None, corpus: Iterable = (), quiet: bool = False) -> dict:
    """Write one MLX folder with the target and its MTP drafter (docs/models.md says what
    goes where), as ``python -m mlx_mtp.convert`` does.

    Args:
        hf_path (str): The source checkpoint's folder or Hugging Face repo id.
        mlx_path (str): The folder to write; it must not exist.
        quantize (bool): Quantize the target (affine). Default: ``False``.
        q_bits (int, optional): The target's bits, with ``quantize``. Default: ``None`` (4).
        q_group_size (int, optional): The target's group size, with ``quantize``.
          Default: ``None`` (64).
        dtype (str, optional): The float dtype of what is not quantized. Default: ``None`` (the
          config's).
        drafter (str, optional): The MTP head if the checkpoint has none; for Gemma 4 the
          assistant checkpoint. Default: ``None``.
        head_bits (int, optional): Quantize the MTP head's projections to these bits.
          Default: ``None``.
        head_group_size (int): The head's quantization group size. Default: ``64``.
        draft_vocab (int, optional): Also write a reduced draft vocabulary of this many ids
          (needs ``corpus``). Default: ``None``.
        corpus (Iterable): UTF-8 text files for the draft vocabulary. Default: ``()``.
        quiet (bool): No progress bars. Default: ``False``.

    Returns:
        dict: What was written (``out``, ``source``, ``model_type``, dtype, quantization and the
          family's drafter fields), as ``--json`` prints it.
    """
    out = Path(mlx_path)
    corpus = [Path(c) for c in corpus]
    _check_args(out, q_bits, q_group_size, dtype, head_bits, head_group_size, draft_vocab, corpus)
    if (q_bits is not None or q_group_size is not None) and not quantize:
        raise MTPError("--q-bits / --q-group-size need -q (--quantize)")
    src = resolve_path(hf_path)
    config = read_config(src)
    model_type = config.get("model_type")
    family = families.for_model_type(model_type)
    if family is None:
        raise MTPError(f"{src / 'config.json'}: unknown model_type {model_type!r}, expected one of "
                       f"{', '.join(families.model_types())}")
    conv = families.Conversion(src=src, config=config, drafter=drafter, head_bits=head_bits,
                               head_group_size=head_group_size, draft_vocab=draft_vocab,
                               corpus=corpus, quiet=quiet)
    family.check_conversion(conv)
    if not weight_files(src, "model*.safetensors"):
        raise MTPError(f"{src}: no model*.safetensors weight files found")
    for f in weight_files(src):
        safetensors_header(f)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        result = _convert_into(tmp, family, conv, quantize=quantize, q_bits=q_bits,
                               q_group_size=q_group_size, dtype=dtype)
        if out.exists():
            raise MTPError(f"--mlx-path {out} appeared while converting: left it as it is")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "source": str(src), "model_type": model_type, **result}


def _convert_into(tmp: Path, family: families.Family, conv: families.Conversion, *, quantize,
                  q_bits, q_group_size, dtype) -> dict:
    src, config, quiet = conv.src, conv.config, conv.quiet
    source = str(src / "config.json")
    is_fp8 = fp8.fp8_block(config, source) is not None
    want = _conversion_dtype(dtype, config)
    # ``lazy``: nothing is read or computed until its shard is written (as mlx_lm.convert)
    model, mlx_config = load_mlx_lm_model(src, config, lazy=True,
                                          fp8_dtype=getattr(mx, want) if want else None)
    tokenizer = mlx_lm_utils.load_tokenizer(src, {"trust_remote_code": False},
                                            eos_token_ids=mlx_config.get("eos_token_id"))
    if is_fp8:
        _drop_quantization_config(mlx_config)
    if want is not None:
        cast = getattr(model, "cast_predicate", None) or (lambda _: True)
        model.update(cast_floats(model.parameters(), getattr(mx, want), cast))
    lm = model.language_model if hasattr(model, "language_model") else model
    head_dtype = lm.model.norm.weight.dtype
    result = {"dtype": str(head_dtype).split(".")[-1], "fp8_dequantized": is_fp8,
              "quantized": bool(quantize)}
    if quantize:
        with contextlib.redirect_stdout(sys.stderr):  # its "[INFO] ..." line; stdout is --json's
            model, mlx_config = mlx_lm_utils.quantize_model(model, mlx_config, q_group_size,
                                                            q_bits)
        result.update(q_bits=mlx_config["quantization"]["bits"],
                      q_group_size=mlx_config["quantization"]["group_size"])

    drafter_config = json.loads(json.dumps(config))
    _drop_quantization_config(drafter_config)
    conv.out, conv.model, conv.dtype, conv.drafter_config = tmp, model, head_dtype, drafter_config
    conv.progress = lambda desc, total: _bar(desc, total, quiet)
    result.update(family.convert_drafter(conv))  # the family's drafter, where its loader looks
    save_target(tmp, src, model, tokenizer, mlx_config, quiet)
    result.update(family.finish_conversion(conv))  # e.g. what is built on the converted folder
    return result



def _head_bits(s):
    if s == "none":
        return None
    if s in map(str, QUANT_BITS):
        return int(s)
    raise argparse.ArgumentTypeError(f"expected none, {', '.join(map(str, QUANT_BITS))}, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m mlx_mtp.convert",
               description="Convert a checkpoint to MLX (mlx-lm's conversion of the target) with "
                           "its MTP head or Gemma 4 assistant in the same folder.")
    p.add_argument("--hf-path", "--model", dest="hf_path", required=True,
                   help="local folder or Hugging Face repo id (BF16 or FP8 block-quantized)")
    p.add_argument("--mlx-path", type=Path, required=True, help="folder to write (must not exist)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the target (affine)")
    p.add_argument("--q-bits", type=int, choices=QUANT_BITS, help="target bits (default 4)")
    p.add_argument("--q-group-size", type=int, choices=QUANT_GROUP_SIZES,
                   help="target group size (default 64)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="float dtype of what is not quantized (default: the config's)")
    p.add_argument("--head-bits", type=_head_bits, default=None, metavar="none|4|8",
                   help="quantize the MTP head's projections (default none)")
    p.add_argument("--head-group-size", type=int, choices=QUANT_GROUP_SIZES, default=64)
    p.add_argument("--draft-vocab", type=positive_int, metavar="N",
                   help="also write a reduced draft vocabulary of N ids (needs --corpus)")
    p.add_argument("--corpus", type=Path, nargs="+", default=[], help="UTF-8 text files")
    p.add_argument("--drafter", help="the MTP head if not in the checkpoint; for Gemma 4 the "
                                     "assistant checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args) -> dict:
    return convert(args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
                   q_group_size=args.q_group_size, dtype=args.dtype, drafter=args.drafter,
                   head_bits=args.head_bits, head_group_size=args.head_group_size,
                   draft_vocab=args.draft_vocab, corpus=args.corpus, quiet=args.quiet)


def _show(r: dict) -> None:
    target = (f"{r['q_bits']}-bit (group {r['q_group_size']})" if r["quantized"] else r["dtype"])
    drafter = ("Gemma 4 assistant" if "assistant" in r else
               "no drafter" if "head_bits" not in r else  # what the family's hook reported
               f"MTP head {r['head_bits']}-bit" if r.get("head_bits") else f"MTP head {r['dtype']}")
    extra = " (FP8 dequantized)" if r["fp8_dequantized"] else ""
    print(f"wrote {r['out']}: target {target}{extra}, {drafter}"
          + (f", draft vocabulary of {r['draft_vocab']['size']} ids" if "draft_vocab" in r else ""))


def main(argv=None) -> int:
    return cli_main(build_parser(), run, _show, argv)


if __name__ == "__main__":
    sys.exit(main())
