"""``onnxparam lora merge|keep|adapter``: LoRA adapters on a model's rank-2 weights;
``onnxparam lora check MODEL ADAPTER``: an adapter file fits an export (``lora="batched"`` or
``lora="inputs"``)."""

import argparse
import re
import warnings
from pathlib import Path

from ._common import (
    EXIT_OK,
    PROG,
    UsageError,
    _existing,
    _check_output,
    _file_format,
    _finite_float,
    _out,
    _positive_int,
    _regex,
    json_result,
)
from ._models import LORA_FACTOR_RE, _add_model_arguments, _architecture, _load_weights
from .convert import _source_tensors

LORA_ACTIONS = ("merge", "keep", "adapter", "check")


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=LORA_ACTIONS,
        help="merge: fold the adapters into the weights; keep: keep the factors (ONNX nodes "
        "x@W + scale*((x@a)@b), or <param>.lora.a/.b tensors in a .bpk); adapter: write the "
        "factors alone; check: does the .onnx_adapter file OUT fit the ONNX export MODEL "
        "(lora='batched' stacks: names, ranks, shapes, dtypes, capacity; or lora='inputs' factors)",
    )
    parser.add_argument(
        "src",
        type=Path,
        metavar="MODEL",
        help="the model: .onnx, or .bpk/.safetensors (base weights, optionally with "
        "<param>.lora.a/.b factors) with --graph/--zoo",
    )
    parser.add_argument(
        "dst",
        type=Path,
        metavar="OUT",
        help="merge/keep: .onnx, .bpk or .safetensors; adapter: .onnx_adapter (ONNX Runtime), .bpk or "
        ".safetensors; check: the .onnx_adapter file to check",
    )
    parser.add_argument(
        "--alpha",
        type=_finite_float,
        metavar="A",
        help="LoRA alpha: scale = alpha / rank (files do not record it, as in Burn); required but for check",
    )
    parser.add_argument(
        "--rank",
        type=_positive_int,
        metavar="R",
        help="adapter rank; read from the factors when there are some, required when not "
        "(fresh adapters: a ~ N(0, 1/R), b = 0)",
    )
    parser.add_argument(
        "--adapter",
        type=Path,
        metavar="FILE",
        help="a .bpk/.safetensors holding the factors (<param>.lora.a/.b), if not in MODEL",
    )
    parser.add_argument(
        "--targets",
        type=_regex,
        action="append",
        metavar="RE",
        help="fresh adapters only on rank-2 weights whose path matches RE (default: every linear map; in an "
        "imported graph, as PEFT, not the tables Gather reads nor an output projection tied to one: name them)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh factors' init (default: 0)")
    _add_model_arguments(parser)


def _factor_shapes(path: Path, fmt: str) -> dict:
    """``param path -> rank`` for every ``<param>.lora.a`` in a weights file's header."""
    tensors = _source_tensors(path, fmt)
    names = {name for name, _, _ in tensors}
    named = sorted({m.group(2) for name in names if (m := re.match(r"^(.+)\.lora\.(.+)\.a$", name)) and m.group(1) in names})
    if named:
        raise ValueError(
            f"'{path}' holds named LoRA adapters {named} (<param>.lora.<name>.a/.b: the save_file of a module with "
            "add_adapter), and this command reads one unnamed adapter (<param>.lora.a/.b); from Python, write the "
            "one you want with onnxparam.save_peft_adapter(module, folder, adapter_name=...) or "
            "onnxparam.write_onnx_adapter, or export with onnxparam.export_onnx")
    ranks = {}
    for name, shape, _ in tensors:
        if name.endswith(".lora.a"):
            if len(shape) != 2:
                raise ValueError(f"'{path}': LoRA factor '{name}' has shape {list(shape)}; expected (d_in, rank)")
            ranks[name[: -len(".lora.a")]] = int(shape[1])
    return ranks


def _run_lora(args: argparse.Namespace) -> int:
    from ..core.errors import LoraError
    from ..core.group import ParamGroup
    from ..lora._adapters import LoraConfig

    if args.action == "check":
        return _run_check(args)
    if args.alpha is None:
        raise UsageError(f"{PROG} lora: error: the following arguments are required: --alpha")
    src_fmt = _file_format(args.src, "model file")
    _existing(args.src, "model file")
    if args.action == "adapter":
        suffix = args.dst.suffix.lower()
        if suffix != ".onnx_adapter":
            _file_format(args.dst, "output file", ("burnpack", "safetensors"))
    else:
        _file_format(args.dst, "output file")
    _check_output(args.dst, args.src, args.adapter)  # a folder, an input, a read-only place: before any work
    factors_file, factors_fmt = None, None
    if args.adapter is not None:
        factors_fmt = _file_format(args.adapter, "the --adapter file", ("burnpack", "safetensors"))
        factors_file = _existing(args.adapter, "the --adapter file")
    elif src_fmt != "onnx":
        factors_file, factors_fmt = args.src, src_fmt

    model = _architecture(args, args.src, src_fmt)
    if src_fmt == "onnx" and args.adapter is None:
        kept = {path: p.adapter() for path, p in model.module.named_params() if p.adapter() is not None}
        if kept:  # a "keep" / "inputs"-with-factors export: its adapters came in with the import
            return _write_kept(args, model, kept)
    ranks = _factor_shapes(factors_file, factors_fmt) if factors_file is not None else {}
    if ranks:
        found = sorted(set(ranks.values()))
        if len(found) > 1:
            raise ValueError(f"'{factors_file}': the LoRA factors have ranks {found}; one rank per file is supported")
        if args.rank is not None and args.rank != found[0]:
            raise ValueError(f"--rank {args.rank} does not match the factors in '{factors_file}' (rank {found[0]})")
        if args.targets:
            raise UsageError(
                f"{PROG} lora: error: --targets chooses where fresh adapters go; '{factors_file}' already has factors"
            )
        rank, group, origin = found[0], ParamGroup.from_paths(sorted(ranks)), f"factors from {factors_file}"
    else:
        if args.adapter is not None:
            peft = (Path(args.adapter).parent / "adapter_config.json").is_file()
            raise ValueError(
                f"the --adapter file '{args.adapter}' has no LoRA factors (<param>.lora.a/.b); "
                + ("it is a PEFT adapter (adapter_config.json beside it): load its folder with "
                   "onnxparam.load_peft_adapter(module, folder) in Python, then export_onnx(..., lora='merge')"
                   if peft else "leave out --adapter for fresh adapters of --rank")
            )
        if args.rank is None:
            where = factors_file or args.src
            raise UsageError(
                f"{PROG} lora: error: '{where}' has no LoRA factors (<param>.lora.a/.b); give --rank "
                "for fresh adapters, or --adapter FILE"
            )
        rank = args.rank
        group = ParamGroup.from_regexes(args.targets) if args.targets else ParamGroup.all()
        origin = f"fresh adapters (seed {args.seed})"
    module = model.module
    # NOTE: MODEL's base weights go in now unless MODEL also holds the factors: those load
    # after apply_lora, base and factors together (the bare module has no place for factors).
    # Fresh adapters keep MODEL's weights and param ids; only the factors are new.
    factors_in_src = bool(ranks) and factors_file == args.src
    if src_fmt != "onnx" and not factors_in_src:
        module = _load_weights(module, args.src, src_fmt)
    with warnings.catch_warnings(record=True) as caught:  # nothing adapted: the error below says why
        warnings.simplefilter("always")
        adapted = module.apply_lora(LoraConfig(rank, args.alpha, param_group=group, seed=args.seed), allow_empty=True)
    for w in caught:
        if "got a LoRA adapter" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if ranks:
        if factors_in_src:
            adapted = _load_weights(adapted, args.src, src_fmt)  # base and factors together
        else:
            adapted = _load_weights(adapted, factors_file, factors_fmt, allow_partial=True)
    model.module = adapted
    names = [path for path, p in adapted.named_params() if p.adapter() is not None]
    if ranks and set(names) != set(ranks):
        strays = sorted(set(ranks) - set(names))
        raise ValueError(
            f"'{factors_file}' has LoRA factors for {len(strays)} weight(s) the model lacks or cannot "
            f"adapt (rank-2 float): {', '.join(strays[:5])}{' ...' if len(strays) > 5 else ''}"
        )
    if not names:
        why = next((str(w.message) for w in caught if "got a LoRA adapter" in str(w.message)), "")
        raise LoraError(f"no rank-2 float weight of '{args.src}' matches the LoRA targets; nothing to adapt"
                        + (f" ({why})" if why else ""))
    if not ranks:
        _check_rank(adapted, names, rank)
    json_result("lora", {"action": args.action, "adapted": names, "rank": rank, "alpha": args.alpha,
                         "scale": args.alpha / rank, "factors": str(factors_file) if ranks else None,
                         "seed": None if ranks else args.seed})
    _out(
        f"lora:      {len(names)} adapted weights, rank {rank}, alpha {args.alpha:g} (scale "
        f"{args.alpha / rank:g}); {origin}"
    )

    return _write_output(args, model, adapted)


def _run_check(args: argparse.Namespace) -> int:
    """``lora check MODEL ADAPTER``: the ``.onnx_adapter`` file fits the export (a batched one:
    :func:`onnxparam.lora._batched_run.check_batched_adapters`; an ``"inputs"`` one:
    :func:`onnxparam.check_onnx_adapter`). A misfit is a ``RecordError`` listing every problem."""
    from ..lora._adapter_file import check_onnx_adapter
    from ..lora._batched import batched_metadata
    from ..lora._batched_run import check_batched_adapters

    for flag in ("alpha", "rank", "adapter", "targets"):
        if getattr(args, flag, None):
            raise UsageError(f"{PROG} lora: error: check takes MODEL and an .onnx_adapter file only; "
                             f"--{flag} does not apply")
    if _file_format(args.src, "model file") != "onnx":
        raise UsageError(f"{PROG} lora: error: check needs an .onnx model; got '{args.src}'")
    if args.dst.suffix.lower() != ".onnx_adapter":
        raise UsageError(f"{PROG} lora: error: check needs an .onnx_adapter file; got '{args.dst}'")
    _existing(args.src, "model file")
    _existing(args.dst, "adapter file")
    meta = batched_metadata(args.src)
    if meta is not None:
        shapes = check_batched_adapters(args.src, args.dst)
        slots = next(iter(shapes.values()))[0] if shapes else 0
        json_result("check", {"kind": "batched", "fits": True, "adapters": meta["adapters"],
                              "capacity": meta["capacity"], "slots": slots,
                              "inputs": {k: list(v) for k, v in sorted(shapes.items())}})
        _out(f"check:     '{args.dst}' fits '{args.src}': {len(shapes)} stacks of {slots} slots "
             f"(index 0: base; capacity {meta['capacity']}; adapters {', '.join(meta['adapters'])})")
        return EXIT_OK
    shapes = check_onnx_adapter(args.dst, args.src)
    json_result("check", {"kind": "inputs", "fits": True, "inputs": {k: list(v) for k, v in sorted(shapes.items())}})
    _out(f"check:     '{args.dst}' fits '{args.src}': {len(shapes)} factors")
    return EXIT_OK


def _write_kept(args: argparse.Namespace, model, kept: dict) -> int:
    """``lora merge|keep|adapter`` on an ONNX file whose adapters the import found (a kept
    export): they are used as they are. ``--alpha`` (and ``--rank``) must give the scale the
    file records, so a mistyped alpha is never silently ignored.

    Raises:
        ValueError: ``--alpha`` / ``--rank`` disagree with the file's adapters, or their ranks differ.
        UsageError: ``--targets`` (it chooses where *fresh* adapters go).
    """
    ranks = sorted({adapter.rank for adapter in kept.values()})
    if len(ranks) > 1:
        raise ValueError(f"'{args.src}' holds LoRA adapters of ranks {ranks}; one rank per file is supported")
    rank = ranks[0]
    if args.targets:
        raise UsageError(f"{PROG} lora: error: --targets chooses where fresh adapters go; '{args.src}' already has "
                         "LoRA factors")
    if args.rank is not None and args.rank != rank:
        raise ValueError(f"--rank {args.rank} does not match the LoRA factors in '{args.src}' (rank {rank})")
    wanted = args.alpha / rank
    off = sorted(path for path, adapter in kept.items() if abs(adapter.scale - wanted) > 1e-6 * max(abs(wanted), 1.0))
    if off:
        scale = kept[off[0]].scale
        name = getattr(model.module, "onnx_names", {}).get(off[0], off[0])  # as the file spells it
        raise ValueError(f"--alpha {args.alpha:g} gives scale {wanted:g} at rank {rank}, but '{args.src}' records "
                         f"scale {scale:g} for {name!r}{' ...' if len(off) > 1 else ''} (alpha {scale * rank:g})")
    json_result("lora", {"action": args.action, "adapted": sorted(kept), "rank": rank, "alpha": args.alpha,
                         "scale": wanted, "factors": str(args.src), "seed": None})
    _out(f"lora:      {len(kept)} adapted weights, rank {rank}, alpha {args.alpha:g} (scale {wanted:g}); "
         f"factors kept in {args.src}")
    return _write_output(args, model, model.module)


def _write_output(args: argparse.Namespace, model, adapted) -> int:
    """Write the adapted module ``adapted`` (of the loaded ``model``) as ``args.action`` asks:
    an ``.onnx_adapter`` file (``adapter``), an ONNX export in that LoRA mode (``.onnx`` OUT), or
    the merged (``merge``) or adapted module's weights; print and record what was written."""
    if args.action == "adapter":
        _write_lora_adapter(adapted, args.dst)
    elif args.dst.suffix.lower() == ".onnx":
        model.export(args.dst, lora=args.action)
    elif args.action == "merge":
        _save_module(adapted.merge_lora(), args.dst)
    else:
        _save_module(adapted, args.dst)
    json_result("written", {"path": str(args.dst), "bytes": args.dst.stat().st_size})
    _out(f"wrote:     {args.dst} ({args.dst.stat().st_size:,} bytes)")
    return EXIT_OK


def _check_rank(module, names: list, rank: int) -> None:
    """Refuse a fresh adapter rank above ``min(d_in, d_out)`` of every adapted weight, warn when
    above that of some: ``a @ b`` has rank at most ``min(d_in, d_out)``, so a larger rank only
    adds parameters (the LoRA paper, Hu et al. 2021, uses ranks far below it).

    Raises:
        ValueError: when ``rank`` exceeds the limit of every weight.
    """
    shapes = {path: tuple(p.lazy_shape()) for path, p in module.named_params() if path in names}
    over = {path: min(shape) for path, shape in shapes.items() if rank > min(shape)}
    if not over:
        return
    listed = ", ".join(f"{path} {list(shapes[path])}" for path in list(over)[:4]) + (" ..." if len(over) > 4 else "")
    if len(over) == len(shapes):
        largest = max(over.values())
        raise ValueError(
            f"--rank {rank} is above min(d_in, d_out) of every adapted weight ({listed}): a larger rank adds "
            f"parameters but no expressiveness; use --rank {largest} or less"
        )
    warnings.warn(
        f"--rank {rank} is above min(d_in, d_out) of {len(over)} adapted weight(s) ({listed}): their adapters "
        "only add parameters; leave them out with --targets, or use a smaller --rank",
        UserWarning,
        stacklevel=2,
    )


def _save_module(module, path: Path) -> None:
    if path.suffix.lower() == ".bpk":
        module.save_file(path)
    else:
        from ..convert import save_safetensors

        save_safetensors(module, path)


def _write_lora_adapter(module, path: Path) -> None:
    if path.suffix.lower() == ".onnx_adapter":
        from ..lora._adapter_file import write_onnx_adapter

        write_onnx_adapter(module, path)
        return
    from ..convert import collect_record, save_safetensors

    if path.suffix.lower() == ".safetensors":
        save_safetensors(module, path, include=LORA_FACTOR_RE)
        return
    from .. import burnpack

    record, _ = collect_record(module, include=LORA_FACTOR_RE)
    entries = (
        burnpack.TensorEntry(
            name,
            s.dtype,
            tuple(s.shape),
            lambda _s=s: _s.to_data().array,
            None if s.param_id is None else int(s.param_id),
        )
        for name, s in record.items()
    )
    burnpack.write(path, entries, metadata=dict(record.metadata))
