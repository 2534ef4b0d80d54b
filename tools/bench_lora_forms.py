"""Other forms of the batched LoRA branch, timed against the exported one
(``python tools/bench_lora_forms.py [--seq 1] [--capacity 4] [--index 1,1,2,2,3,3,4,4]``).

The numbers in the "Cost" section of :mod:`onnxparam.lora._batched` come from this script: it
exports the ``lora-batched`` bench model (:func:`bench.lora_batched_adapters`: one width-512
encoder layer, four adapters of ranks 8 / 16 / 8 / 16 on its six weights), rewrites the
``lora="batched"`` export's branch of every target into each form below (ONNX graph surgery on
the saved file: none of these is an export mode), checks each exact form's rows against the
exported form (1e-5), and times every form with the exported one, the rank-16 ``"inputs"`` run
(``single``), the 4 split ``"inputs"`` runs (``split``) and the base alone in one round robin
(:func:`bench_lora_floor.round_robin_medians`: shuffled, then hot; thread CPU time, one thread).

Per target the exported form is ``MatMul(MatMul(x, Gather(a_stack, i)), Gather(b_stack, i))``
(``x``: ``[batch, seq, d_in]``). The forms (``rows`` = batch, ``S`` = seq, ``slots`` = capacity + 1):

* ``grid``: rows placed in a ``[T, slots]`` grid (``T`` the most rows of one slot; empty cells
  hold row 0, never read back), ``Gather(x, grid) @ a_stack @ b_stack`` (``[T, slots, S, d]``: the
  stacks broadcast over ``T``, read in place, no copy), each row's delta read back by ``GatherND``;
  the grid is built once from the index (~20 nodes on ``[rows]`` int64 values).
* ``grid used``: the same grid over the slots the rows use (``Unique``), the stacks gathered at
  those slots (a copy of the used slots instead of one per row).
* ``masked packed``: every row by every slot's ``a`` (``[1, rows * S, d_in] @ a_stack``), masked to
  the row's slot, then one ``MatMul`` with ``b_stack`` viewed ``[slots * r, d_out]``.
* ``masked rows``: ``[rows, 1, S, d_in] @ a_stack`` (one-row products broadcast over
  ``[rows, slots]``), masked, then ``b_stack`` per slot and ``ReduceSum`` over the slots.
* ``if grid``: an ``If`` per target, the ``grid`` form when ``S == 1``, the exported one otherwise.
* ``if all``: one ``If`` holding the whole graph after the index check twice, the ``grid`` form's
  when ``S == 1`` and the exported one's otherwise (the weights stay outer-scope initializers:
  nothing is copied).
* ``if used``: the same with the ``grid used`` form, taken when ``S == 1`` and its cells are at most
  the rows plus the used slots (``T * U <= rows + U``: not when most rows share one of several
  adapters), the exported form otherwise.
* ``groups`` (not an export: rows must come grouped by adapter, as ``--index`` gives them): each
  adapter's rows (``Gather`` of ``x``) through that adapter's own factors held as separate inputs,
  concatenated back: every used adapter's factors read once, no stack copy.
* ``rank wide`` (timing only, not exact): one adapter holding the used adapters' factors side by
  side (rank ``4 * 16``) on every row: the bytes of reading four adapters, the nodes of one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FORMS = ("grid", "grid used", "masked packed", "masked rows", "if grid", "if all", "if used", "groups", "rank wide")
EXACT = {"grid", "grid used", "masked packed", "masked rows", "if grid", "if all", "if used", "groups"}


def _targets(graph):
    """``[(gather_a, gather_b, matmul_a, matmul_b)]``: the exported branch of each target."""
    uses = {}
    for node in graph.node:
        for name in node.input:
            uses.setdefault(name, []).append(node)
    found = []
    for node in graph.node:
        if node.op_type == "Gather" and node.input[0].endswith(".lora.a_stack"):
            b_name = node.input[0][:-len("a_stack")] + "b_stack"
            gather_b = next(n for n in graph.node if n.op_type == "Gather" and n.input[0] == b_name)
            found.append((node, gather_b, uses[node.output[0]][0], uses[gather_b.output[0]][0]))
    return found


def _i64(values, name):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _grid_nodes(index, slots, prefix):
    """Nodes building ``{prefix}.grid`` ``[T, slots]`` (row ids) and ``{prefix}.nd`` ``[rows, 2]``
    (each row's cell) from ``index`` (each row's column in ``[0, slots)``) and ``slots`` (``[1]``)."""
    from onnx import helper as h

    p = prefix
    return [
        h.make_node("OneHot", [index, slots, "f.onoff"], [f"{p}.onehot"]),
        h.make_node("CumSum", [f"{p}.onehot", "f.zero"], [f"{p}.before"], exclusive=1),
        h.make_node("Mul", [f"{p}.before", f"{p}.onehot"], [f"{p}.mine"]),
        h.make_node("ReduceSum", [f"{p}.mine", "f.axis1"], [f"{p}.pos"], keepdims=0),
        h.make_node("ReduceSum", [f"{p}.onehot", "f.axis0"], [f"{p}.counts"], keepdims=0),
        h.make_node("ReduceMax", [f"{p}.counts"], [f"{p}.T"], keepdims=1),
        h.make_node("Mul", [f"{p}.pos", slots], [f"{p}.pos_slots"]),
        h.make_node("Add", [f"{p}.pos_slots", index], [f"{p}.cell"]),
        h.make_node("Mul", [f"{p}.T", slots], [f"{p}.cells"]),
        h.make_node("Expand", ["f.zero1", f"{p}.cells"], [f"{p}.empty"]),
        h.make_node("Shape", [index], [f"{p}.rows"]),
        h.make_node("Squeeze", [f"{p}.rows"], [f"{p}.rows0"]),
        h.make_node("Range", ["f.zero", f"{p}.rows0", "f.one"], [f"{p}.row_ids"]),
        h.make_node("ScatterElements", [f"{p}.empty", f"{p}.cell", f"{p}.row_ids"], [f"{p}.flat"]),
        h.make_node("Concat", [f"{p}.T", slots], [f"{p}.grid_shape"], axis=0),
        h.make_node("Reshape", [f"{p}.flat", f"{p}.grid_shape"], [f"{p}.grid"]),
        h.make_node("Unsqueeze", [f"{p}.pos", "f.axis1"], [f"{p}.pos2"]),
        h.make_node("Unsqueeze", [index, "f.axis1"], [f"{p}.index2"]),
        h.make_node("Concat", [f"{p}.pos2", f"{p}.index2"], [f"{p}.nd"], axis=1),
    ]


def rewrite(path, out, form: str, rows=None):
    """The batched export at ``path`` with every target's branch in ``form`` (module docstring),
    saved to ``out``; ``rows``: the index the ``groups`` form is built for. Returns ``out``."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as h
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    targets = _targets(graph)
    index = targets[0][0].input[1]  # the checked index every stack Gather reads
    stacks = {i.name: i for i in graph.initializer}
    graph.initializer.extend([_i64([0, 1], "f.onoff"), _i64(0, "f.zero"), _i64(1, "f.one"), _i64([0], "f.zero1"),
                              _i64([0], "f.axis0"), _i64([1], "f.axis1"), _i64([-1], "f.minus1"),
                              _i64([1, 3], "f.axes13"), _i64([1, -1, 0], "f.all_rows"), _i64([0, 0, -1], "f.flat3")])
    shared, replaced, dropped = [], {}, set()
    if form in ("grid", "if grid", "masked packed"):
        shared.append(h.make_node("Shape", [targets[0][0].input[0]], ["f.slots"], end=1))
    if form in ("grid", "if grid"):
        shared += _grid_nodes(index, "f.slots", "g")
    if form == "grid used":
        shared += [h.make_node("Unique", [index], ["u.used", "", "u.column", "u.counts"], sorted=1),
                   h.make_node("Shape", ["u.used"], ["u.slots"])]
        shared += _grid_nodes("u.column", "u.slots", "g")
    if form == "masked packed":
        shared += [h.make_node("OneHot", [index, "f.slots", "f.onoff_f"], ["m.onehot"]),
                   h.make_node("Unsqueeze", ["m.onehot", "f.axes13"], ["m.mask"]),  # [rows, 1, slots, 1]
                   h.make_node("Shape", [index], ["m.rows"])]
        graph.initializer.append(numpy_helper.from_array(np.asarray([0.0, 1.0], np.float32), "f.onoff_f"))
    if form == "masked rows":
        shared += [h.make_node("Shape", [targets[0][0].input[0]], ["f.slots"], end=1),
                   h.make_node("OneHot", [index, "f.slots", "f.onoff_f"], ["m.onehot"]),
                   h.make_node("Unsqueeze", ["m.onehot", "f.axes23"], ["m.mask"])]  # [rows, slots, 1, 1]
        graph.initializer.extend([numpy_helper.from_array(np.asarray([0.0, 1.0], np.float32), "f.onoff_f"),
                                  _i64([2, 3], "f.axes23")])
    if form == "groups":
        used = sorted(set(int(r) for r in rows))
        for k in used:
            part = np.flatnonzero(np.asarray(rows) == k)
            if part.size == 0 or (np.diff(part) != 1).any():
                raise SystemExit(f"--forms groups needs each adapter's rows contiguous; got {list(rows)}")
            graph.initializer.append(_i64(part, f"f.part{k}"))
    for gather_a, gather_b, matmul_a, matmul_b in targets:
        x, a_stack, b_stack, delta = matmul_a.input[0], gather_a.input[0], gather_b.input[0], matmul_b.output[0]
        p = a_stack[:-len(".a_stack")]
        dropped |= {gather_a.output[0], gather_b.output[0], matmul_a.output[0], delta}
        grid = [h.make_node("Gather", [x, "g.grid"], [f"{p}.x_grid"], axis=0),      # [T, slots, S, d_in]
                h.make_node("MatMul", [f"{p}.x_grid", a_stack], [f"{p}.h"]),
                h.make_node("MatMul", [f"{p}.h", b_stack], [f"{p}.y_grid"]),         # [T, slots, S, d_out]
                h.make_node("GatherND", [f"{p}.y_grid", "g.nd"], [delta])]
        if form == "grid":
            nodes = grid
        elif form == "grid used":
            nodes = [h.make_node("Gather", [a_stack, "u.used"], [f"{p}.a_used"], axis=0),
                     h.make_node("Gather", [b_stack, "u.used"], [f"{p}.b_used"], axis=0)] + grid
            nodes[3].input[1], nodes[4].input[1] = f"{p}.a_used", f"{p}.b_used"
        elif form == "masked packed":
            nodes = [h.make_node("Reshape", [x, "f.all_rows"], [f"{p}.x_all"]),      # [1, rows * S, d_in]
                     h.make_node("MatMul", [f"{p}.x_all", a_stack], [f"{p}.h"]),    # [slots, rows * S, r]
                     h.make_node("Transpose", [f"{p}.h"], [f"{p}.h_rows"], perm=[1, 0, 2]),
                     h.make_node("Shape", [f"{p}.h_rows"], [f"{p}.h_tail"], start=1),
                     h.make_node("Concat", ["m.rows", "f.minus1", f"{p}.h_tail"], [f"{p}.h_shape"], axis=0),
                     h.make_node("Reshape", [f"{p}.h_rows", f"{p}.h_shape"], [f"{p}.h4"]),  # [rows, S, slots, r]
                     h.make_node("Mul", [f"{p}.h4", "m.mask"], [f"{p}.h_masked"]),
                     h.make_node("Reshape", [f"{p}.h_masked", "f.flat3"], [f"{p}.h_flat"]),
                     h.make_node("Shape", [b_stack], [f"{p}.d_out"], start=2),
                     h.make_node("Concat", ["f.minus1", f"{p}.d_out"], [f"{p}.b_shape"], axis=0),
                     h.make_node("Reshape", [b_stack, f"{p}.b_shape"], [f"{p}.b_flat"]),
                     h.make_node("MatMul", [f"{p}.h_flat", f"{p}.b_flat"], [delta])]
        elif form == "masked rows":
            nodes = [h.make_node("Unsqueeze", [x, "f.axis1"], [f"{p}.x4"]),             # [rows, 1, S, d_in]
                     h.make_node("MatMul", [f"{p}.x4", a_stack], [f"{p}.h"]),          # [rows, slots, S, r]
                     h.make_node("Mul", [f"{p}.h", "m.mask"], [f"{p}.h_masked"]),
                     h.make_node("MatMul", [f"{p}.h_masked", b_stack], [f"{p}.y_slots"]),
                     h.make_node("ReduceSum", [f"{p}.y_slots", "f.axis1"], [delta], keepdims=0)]
        elif form == "if grid":
            rowwise = [h.make_node("Gather", [a_stack, index], [f"{p}.A"], axis=0),
                       h.make_node("Gather", [b_stack, index], [f"{p}.B"], axis=0),
                       h.make_node("MatMul", [x, f"{p}.A"], [f"{p}.h_rows"]),
                       h.make_node("MatMul", [f"{p}.h_rows", f"{p}.B"], [f"{p}.delta_rows"])]
            back = h.make_node("GatherND", [f"{p}.y_grid", "g.nd"], [f"{p}.delta_grid"])
            branch_grid = h.make_graph(grid[:3] + [back], f"{p}.grid", [],
                                       [h.make_tensor_value_info(f"{p}.delta_grid", TensorProto.FLOAT, None)])
            branch_rows = h.make_graph(rowwise, f"{p}.rows", [],
                                       [h.make_tensor_value_info(f"{p}.delta_rows", TensorProto.FLOAT, None)])
            nodes = [h.make_node("If", ["f.one_token"], [delta], then_branch=branch_grid, else_branch=branch_rows)]
        elif form in ("groups", "rank wide"):
            a, b = numpy_helper.to_array(stacks[a_stack]), numpy_helper.to_array(stacks[b_stack])
            used = sorted(set(int(r) for r in rows))
            nodes = []
            held = [(f"{p}.a{k}", a[k], f"{p}.b{k}", b[k]) for k in used] if form == "groups" else \
                [(f"{p}.a_wide", np.concatenate([a[k] for k in used], 1), f"{p}.b_wide",
                  np.concatenate([b[k] for k in used], 0))]
            for a_name, a_value, b_name, b_value in held:
                for name, value in ((a_name, a_value), (b_name, b_value)):
                    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
                    graph.input.append(h.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape)))
            if form == "rank wide":
                nodes = [h.make_node("MatMul", [x, f"{p}.a_wide"], [f"{p}.h"]),
                         h.make_node("MatMul", [f"{p}.h", f"{p}.b_wide"], [delta])]
            else:
                for k in used:
                    nodes += [h.make_node("Gather", [x, f"f.part{k}"], [f"{p}.x{k}"], axis=0),
                              h.make_node("MatMul", [f"{p}.x{k}", f"{p}.a{k}"], [f"{p}.h{k}"]),
                              h.make_node("MatMul", [f"{p}.h{k}", f"{p}.b{k}"], [f"{p}.y{k}"])]
                nodes.append(h.make_node("Concat", [f"{p}.y{k}" for k in used], [delta], axis=0))
        else:
            raise SystemExit(f"unknown form {form!r}; one of {FORMS}")
        replaced[delta] = nodes
    if form == "if grid":
        shared += [h.make_node("Shape", [graph.input[0].name], ["f.seq"], start=1, end=2),
                   h.make_node("Equal", ["f.seq", "f.one1"], ["f.one_token1"]),
                   h.make_node("Squeeze", ["f.one_token1"], ["f.one_token"])]
        graph.initializer.append(_i64([1], "f.one1"))
    kept = []
    for node in graph.node:
        if node.output[0] in replaced:
            kept += replaced[node.output[0]]
        elif node.output[0] not in dropped:
            kept.append(node)
    at = next(i for i, node in enumerate(kept) if index in node.output) + 1
    kept[at:at] = shared
    del graph.node[:]
    graph.node.extend(kept)
    onnx.save(model, str(out))
    return out


def if_all(path, out, grid_path, bounded: bool = False):
    """The export at ``path`` as one ``If`` on ``S == 1`` after the index check: the graph of
    ``grid_path`` (:func:`rewrite` of ``path`` to ``"grid"`` or ``"grid used"``) in one branch, the
    export's own in the other, each branch's values renamed apart; ``bounded``: the grid only when
    its cells are at most the rows plus its slots. Saved to ``out``; returns it."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as h

    grid_model, exported = onnx.load(str(grid_path)), onnx.load(str(path))
    index = _targets(exported.graph)[0][0].input[1]
    nodes = list(exported.graph.node)
    head = next(i for i, node in enumerate(nodes) if index in node.output) + 1
    grid_nodes = list(grid_model.graph.node)[head:]
    first = next(i for i, node in enumerate(grid_nodes) if not node.output[0].startswith(("f.", "g.", "u.", "m.")))

    def branch(body, suffix):
        made = {name for node in body for name in node.output}
        renamed = []
        for node in body:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            for i, name in enumerate(copy.input):
                if name in made:
                    copy.input[i] = name + suffix
            for i, name in enumerate(copy.output):
                copy.output[i] = name + suffix
            copy.name = copy.name + suffix if copy.name else ""
            renamed.append(copy)
        outputs = [h.make_tensor_value_info(o.name + suffix, TensorProto.FLOAT, None) for o in exported.graph.output]
        return h.make_graph(renamed, suffix, [], outputs)

    graph = grid_model.graph
    choose = [h.make_node("Shape", [graph.input[0].name], ["c.seq"], start=1, end=2),
              h.make_node("Equal", ["c.seq", "c.one"], ["c.one_token1"])]
    if bounded:
        slots = "u.slots" if any(node.output[0] == "u.slots" for node in grid_nodes) else "f.slots"
        choose += [h.make_node("Add", ["g.rows", slots], ["c.room"]),
                   h.make_node("LessOrEqual", ["g.cells", "c.room"], ["c.fits"]),
                   h.make_node("And", ["c.one_token1", "c.fits"], ["c.grid1"]),
                   h.make_node("Squeeze", ["c.grid1"], ["c.one_token"])]
    else:
        choose.append(h.make_node("Squeeze", ["c.one_token1"], ["c.one_token"]))
    choose.append(h.make_node("If", ["c.one_token"], [o.name for o in exported.graph.output],
                              then_branch=branch(grid_nodes[first:], "@grid"),
                              else_branch=branch(nodes[head:], "@rows")))
    kept = nodes[:head] + grid_nodes[:first] + choose
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.append(_i64([1], "c.one"))
    onnx.save(grid_model, str(out))
    return out


def with_capacity(path, out, slots: int):
    """The export at ``path`` with every stack zero-padded to ``slots`` slots (a larger capacity)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    for i, init in enumerate(model.graph.initializer):
        if init.name.endswith((".lora.a_stack", ".lora.b_stack")):
            value = numpy_helper.to_array(init)
            pad = np.zeros((slots - value.shape[0],) + value.shape[1:], value.dtype)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.concatenate([value, pad]), init.name))
    onnx.save(model, str(out))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1, help="tokens per row (default 1)")
    parser.add_argument("--capacity", type=int, default=4, help="adapter slots, zero-padded (default 4)")
    parser.add_argument("--index", default="1,1,2,2,3,3,4,4", help="each row's adapter index (default 1,1,2,2,3,3,4,4)")
    parser.add_argument("--forms", default=",".join(f for f in FORMS if f != "if grid"),
                        help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    import onnxruntime as ort

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench
    from bench_lora_floor import round_robin_medians

    from onnxparam import export_onnx

    rows = np.asarray([int(i) for i in args.index.split(",")], dtype=np.int64)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    base = bench.lora_batched_base()
    module, names = bench.lora_batched_adapters(base, 100)
    x = np.random.default_rng(0).normal(size=(len(rows), args.seq, bench.LORA_WIDTH)).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-lora-forms-") as tmp:
        folder = Path(tmp)

        def session(path):
            return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])

        batched_path = export_onnx(module, folder / "batched.onnx", x, lora="batched")
        if args.capacity != len(names):
            batched_path = with_capacity(batched_path, folder / "batched-capacity.onnx", args.capacity + 1)
        inputs = session(export_onnx(module, folder / "inputs.onnx", x, lora="inputs"))
        plain = session(export_onnx(base, folder / "base.onnx", x))
        run_options, keep = bench.adapter_run_options(module, names, folder)
        parts = [(k, np.flatnonzero(rows == k + 1)) for k in range(len(names)) if (rows == k + 1).any()]
        plain_input = plain.get_inputs()[0].name
        fns = {"single": lambda: inputs.run(None, {"x": x}, run_options[1]),
               "split": lambda: [inputs.run(None, {"x": x[part]}, run_options[k]) for k, part in parts],
               "base": lambda: plain.run(None, {plain_input: x})}
        exported = session(batched_path)
        feed = {"x": x, "adapter_index": rows}
        expected = exported.run(None, feed)[0]
        fns["batched"] = lambda: exported.run(None, feed)
        for form in forms:
            if form in ("if all", "if used"):
                grid_form = "grid" if form == "if all" else "grid used"
                grid_path = rewrite(batched_path, folder / "grid-for-if.onnx", grid_form, rows)
                name = form.replace(" ", "-")
                s = session(if_all(batched_path, folder / f"{name}.onnx", grid_path, form == "if used"))
            else:
                s = session(rewrite(batched_path, folder / f"{form.replace(' ', '-')}.onnx", form, rows))
            if form in EXACT:
                np.testing.assert_allclose(s.run(None, feed)[0], expected, rtol=1e-5, atol=1e-5)
            fns[form] = (lambda s: lambda: s.run(None, feed))(s)
        for hot in (False, True):
            load = os.getloadavg()[0]
            t = round_robin_medians(fns, args.repeats, clock=time.thread_time, hot=hot)
            print(f"seq {args.seq}, capacity {args.capacity}, index {args.index}, {'hot' if hot else 'shuffled'}, "
                  f"thread CPU time, {args.repeats} repeats, 1-min load {load:.2f} -> {os.getloadavg()[0]:.2f}")
            for name, value in t.items():
                print(f"  {name:14s} {value * 1e3:8.3f} ms   / single {value / t['single']:.3f}   "
                      f"/ split {value / t['split']:.3f}   / batched {value / t['batched']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
