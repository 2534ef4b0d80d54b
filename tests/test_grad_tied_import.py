"""A tied embedding / output projection (GPT-2's ``wte`` / ``lm_head``) of a torch-exported ONNX
file trains as torch's ONE tied weight (fresh7 F3).

torch's exporters write the tied pair as two initializers: the table ``Gather`` reads
``(vocab, dim)`` and its transposed copy ``MatMul`` reads ``(dim, vocab)`` (TorchScript's
``onnx::MatMul_N``, dynamo's ``val_N``). Both import as params; ``OnnxModule.onnx_ties`` lists
the pair, and ``grad`` gives both the summed gradient. The oracle is torch autograd on the same
weights: every imported param's gradient equals torch's (the table's and the projection's are
torch's ``wte.grad``, the latter transposed), two SGD / Adam steps give torch's logits, the pair
stays bit-equal after training (an export writes a tied model), and an unmodified import exports
the file's graph.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from torch_tied import VOCAB, export_quietly, tiny_lm  # noqa: E402

import onnxparam as op  # noqa: E402
from onnxparam.autodiff import grad  # noqa: E402
from onnxparam.optim import SGD, Adam  # noqa: E402

SEQ = 5
RTOL = 1e-4


def _export(model, path, ids, exporter: str, dynamic_axes=None):
    export_quietly(model, ids, path, exporter, dynamic_axes)
    return op.import_onnx(path)


def _loss_torch(model, ids, target):
    return ((model(ids) - target) ** 2).mean()


def _loss(m, ids, target):
    return ((m(ids) - target) ** 2).mean()


def _data(seed=1, batch=2, seq=SEQ, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, seq)).astype(np.int64)
    target = rng.normal(size=(batch, seq, vocab)).astype(np.float32)
    return ids, target


def _by_values(imported, model):
    """torch param name -> [(imported path, transposed)] whose imported value equals torch's
    (as stored or transposed): which imported param holds which torch weight."""
    values = {p: np.asarray(q.val().to_numpy()) for p, q in imported.named_params()}
    out = {}
    for name, w in model.named_parameters():
        w = w.detach().numpy()
        out[name] = [(p, transposed) for p, v in values.items() for transposed in (False, True)
                     if v.shape == (w.T if transposed else w).shape and np.array_equal(v, w.T if transposed else w)]
    return out


def _check_grads(imported, model, ids, target):
    """Every imported param's gradient equals torch's gradient of the weight it holds."""
    model.zero_grad()
    _loss_torch(model, torch.tensor(ids), torch.tensor(target)).backward()
    loss, grads = grad(_loss, imported, op.Tensor.from_numpy(ids), op.Tensor.from_numpy(target))
    params = dict(imported.named_params())
    held = _by_values(imported, model)
    checked = set()
    for name, w in model.named_parameters():
        want = w.grad.numpy()
        assert held[name], f"torch's {name} is in no imported param"
        for path, transposed in held[name]:
            got = grads[params[path]].to_numpy()
            got = got.T if transposed else got
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max(), err_msg=path)
            checked.add(path)
    trainable = {p for p, q in params.items() if q.require_grad}
    assert trainable <= checked, f"params not checked against torch: {sorted(trainable - checked)}"
    return held


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def tiny(request, tmp_path_factory):
    model = tiny_lm()
    ids, target = _data()
    imported = _export(model, tmp_path_factory.mktemp("tie") / "lm.onnx", torch.tensor(ids), request.param)
    return model, imported, ids, target


def test_the_file_ties_the_table_and_its_transposed_projection_and_lists_the_pair(tiny):
    model, imported, _, _ = tiny
    ties = imported.onnx_ties
    assert len(ties) == 1
    (head, (table, transposed)), = ties.items()
    assert transposed
    params = dict(imported.named_params())
    wte = model.wte.weight.detach().numpy()
    np.testing.assert_array_equal(params[table].val().to_numpy(), wte)  # the Gather table is torch's wte
    np.testing.assert_array_equal(params[head].val().to_numpy(), wte.T)  # the projection its transposed copy
    # the untied Linear's weight is no tie
    assert len(ties) == 1 and all(p in params for p in (head, table))


def test_every_gradient_equals_torchs_and_the_tied_pair_gets_wte_grad(tiny):
    model, imported, ids, target = tiny
    held = _check_grads(imported, model, ids, target)
    assert len(held["wte.weight"]) == 2  # both sides of the tie checked against torch's wte.grad


OPTIMIZERS = {"sgd": lambda lr: (SGD(lr=lr), torch.optim.SGD, {"lr": lr}),
              "adam": lambda lr: (Adam(lr=lr, eps=1e-8), torch.optim.Adam, {"lr": lr, "eps": 1e-8})}


def _two_steps(model0, fresh, imported, ids, target, make_opt, tmp_path):
    """Two steps of the same optimizer here and in torch (on ``fresh()`` with ``model0``'s
    weights: a fixture's model is shared): the logits agree with torch's, the tied pair stays
    bit-equal (the table's transposed) and the exported file holds it so. Returns the trained
    module, the trained torch model, the table's trained param and the exported file."""
    model = fresh()
    model.load_state_dict(model0.state_dict())
    opt, torch_opt, kwargs = make_opt()
    topt = torch_opt(model.parameters(), **kwargs)
    m = imported
    for _ in range(2):
        topt.zero_grad()
        _loss_torch(model, torch.tensor(ids), torch.tensor(target)).backward()
        topt.step()
        _, grads = grad(_loss, m, op.Tensor.from_numpy(ids), op.Tensor.from_numpy(target))
        m = opt.step(m, grads)
    with torch.no_grad():
        want = model(torch.tensor(ids)).numpy()
    got = m(op.Tensor.from_numpy(ids)).to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    (head, (table, _)), = imported.onnx_ties.items()
    params = dict(m.named_params())
    np.testing.assert_array_equal(params[head].val().to_numpy(), params[table].val().to_numpy().T)  # still tied
    path = tmp_path / "trained.onnx"
    op.export_onnx(m, path)
    written = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    names = imported.onnx_names
    np.testing.assert_array_equal(written[names[head]], written[names[table]].T)
    return m, model, params[table], path


@pytest.mark.parametrize("make_opt", [lambda: OPTIMIZERS["sgd"](0.5), lambda: OPTIMIZERS["adam"](0.05)],
                         ids=["sgd", "adam"])
def test_two_steps_match_torch_and_the_pair_stays_tied_in_the_export(tiny, make_opt, tmp_path):
    model0, imported, ids, target = tiny
    _, model, table, path = _two_steps(model0, tiny_lm, imported, ids, target, make_opt, tmp_path)
    np.testing.assert_allclose(table.val().to_numpy(), model.wte.weight.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert op.import_onnx(path).onnx_ties == imported.onnx_ties  # the trained file is tied again


def test_an_unmodified_import_exports_the_files_graph(tiny, tmp_path):
    _exports_the_files_graph(tiny[1], tmp_path)


def _exports_the_files_graph(imported, tmp_path):
    path = tmp_path / "again.onnx"
    op.export_onnx(imported, path)
    source = onnx.load(str(imported.source_path))
    again = onnx.load(str(path))
    assert [(n.op_type, list(n.input), list(n.output)) for n in again.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in source.graph.node]
    assert {t.name: t.raw_data or numpy_helper.to_array(t).tobytes() for t in again.graph.initializer} == \
        {t.name: t.raw_data or numpy_helper.to_array(t).tobytes() for t in source.graph.initializer}


def test_a_pair_untied_by_a_checkpoint_or_frozen_on_one_side_trains_as_two_params(tiny):
    """The sum is for a pair that IS tied: values loaded into one side differ (two weights
    now), or one side frozen: each side gets its own gradient (torch of an untied model)."""
    model, imported, ids, target = tiny
    (head, (table, _)), = imported.onnx_ties.items()
    params = dict(imported.named_params())
    untied_model = tiny_lm()
    untied_model.load_state_dict(model.state_dict())
    untied_model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone() + 0.25)  # untied
    new_head = op.Tensor.from_numpy(np.ascontiguousarray(untied_model.lm_head.weight.detach().numpy().T))
    from onnxparam.core.module import rebuild

    changed = rebuild(imported, lambda path, p: p.map(lambda _old: new_head) if path == head else p)
    untied_model.zero_grad()
    _loss_torch(untied_model, torch.tensor(ids), torch.tensor(target)).backward()
    _, grads = grad(_loss, changed, op.Tensor.from_numpy(ids), op.Tensor.from_numpy(target))
    cparams = dict(changed.named_params())
    np.testing.assert_allclose(grads[cparams[table]].to_numpy(), untied_model.wte.weight.grad.numpy(), rtol=RTOL,
                               atol=1e-7)
    np.testing.assert_allclose(grads[cparams[head]].to_numpy().T, untied_model.lm_head.weight.grad.numpy(),
                               rtol=RTOL, atol=1e-7)
    # one side frozen: the other gets only its own part (torch: a detached copy of the weight)
    frozen = imported.freeze_group(op.ParamGroup.from_paths([head]))
    _, grads = grad(_loss, frozen, op.Tensor.from_numpy(ids), op.Tensor.from_numpy(target))
    assert params[head].id not in grads
    detached = tiny_lm()
    detached.load_state_dict(model.state_dict())
    detached.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone(), requires_grad=False)
    detached.zero_grad()
    _loss_torch(detached, torch.tensor(ids), torch.tensor(target)).backward()
    np.testing.assert_allclose(grads[params[table]].to_numpy(), detached.wte.weight.grad.numpy(), rtol=RTOL,
                               atol=1e-7)


# -- a tiny GPT-2 (transformers' GPT2LMHeadModel: lm_head tied to wte) --------------------------


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # no two weights equal: the exporters merge equal initializers (README)
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert base.lm_head.weight is base.transformer.wte.weight
    return _Logits(base)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(input_ids=ids).logits  # (use_cache=False makes TorchScript meet aten::diff)


def _holders(imported, model):
    """imported path -> [(torch name, how)] for each trainable imported param: ``how`` is
    ``"same"``, ``"t"`` (transposed) or ``"rows"`` (the first rows of a table: dynamo folds
    ``wpe[position ids]`` of a static sequence into a constant)."""
    out = {}
    torch_values = {n: w.detach().numpy() for n, w in model.named_parameters()}
    for path, p in imported.named_params():
        if not p.require_grad:
            continue
        v = np.asarray(p.val().to_numpy())
        found = []
        for name, w in torch_values.items():
            if v.shape == w.shape and np.array_equal(v, w):
                found.append((name, "same"))
            elif v.shape == w.T.shape and np.array_equal(v, w.T):
                found.append((name, "t"))
            elif w.ndim == 2 and v.shape[-1] == w.shape[1] and v.size < w.size and \
                    np.array_equal(v.reshape(-1, w.shape[1]), w[: v.size // w.shape[1]]):
                found.append((name, "rows"))
        out[path] = found
    return out


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def gpt2(request, tmp_path_factory):
    model = _gpt2()
    ids, target = _data(seed=2, batch=2, seq=7, vocab=50)
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.onnx"
    # dynamo as fresh7 ran it (static shapes, the default optimizer); TorchScript with dynamic axes
    imported = _export(model, path, torch.tensor(ids), request.param,
                       dynamic_axes={"ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    return model, imported, ids, target


@pytest.mark.slow  # transformers and two exports: ~15 s on this CPU
def test_gpt2_every_gradient_equals_torchs_and_the_tied_table_gets_wte_grad(gpt2):
    model, imported, ids, target = gpt2
    (head, (table, transposed)), = imported.onnx_ties.items()
    assert transposed
    wte = model.m.transformer.wte.weight.detach().numpy()
    params = dict(imported.named_params())
    np.testing.assert_array_equal(params[table].val().to_numpy(), wte)
    np.testing.assert_array_equal(params[head].val().to_numpy(), wte.T)
    model.zero_grad()
    _loss_torch(model, torch.tensor(ids), torch.tensor(target)).backward()
    tgrads = {n: w.grad.numpy() for n, w in model.named_parameters()}
    _, grads = grad(_loss, imported, op.Tensor.from_numpy(ids), op.Tensor.from_numpy(target))
    covered = set()
    for path, found in _holders(imported, model).items():
        assert len(found) == 1, f"{path}: held by {found}"  # perturbed: one torch weight each
        name, how = found[0]
        got = np.asarray(grads[params[path]].to_numpy())
        want = tgrads[name]
        want = want.T if how == "t" else want[: got.size // want.shape[1]].reshape(got.shape) if how == "rows" else want
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=path)
        covered.add(name)
    assert covered == set(tgrads)  # every torch param checked (wte through both sides of the tie)
    assert {n for n, h in _holders(imported, model)[head]} == {"m.transformer.wte.weight"}


@pytest.mark.slow
@pytest.mark.parametrize("make_opt", [lambda: OPTIMIZERS["sgd"](0.5), lambda: OPTIMIZERS["adam"](0.01)],
                         ids=["sgd", "adam"])
def test_gpt2_two_steps_match_torch_and_stay_tied(gpt2, make_opt, tmp_path):
    model0, imported, ids, target = gpt2
    _two_steps(model0, _gpt2, imported, ids, target, make_opt, tmp_path)


@pytest.mark.slow
def test_gpt2_unmodified_import_exports_the_files_graph(gpt2, tmp_path):
    _exports_the_files_graph(gpt2[1], tmp_path)


def test_the_summed_gradients_of_a_table_larger_than_one_block_are_the_numpy_sum():
    """The sum runs in row blocks of the table (cache-friendly transposes): a 300-row table (several
    blocks and a partial one) against numpy's ``g_table + g_head.T``; a side the loss misses is zeros;
    one value changed on one side unties the pair."""
    from onnxparam.autodiff._ties import tie_gradients

    rng = np.random.default_rng(5)
    t = rng.normal(size=(300, 7)).astype(np.float32)
    table = op.Param(op.ParamId(), value=op.Tensor.from_numpy(t))
    head = op.Param(op.ParamId(), value=op.Tensor.from_numpy(np.ascontiguousarray(t.T)))
    gt, gh = rng.normal(size=(300, 7)).astype(np.float32), rng.normal(size=(7, 300)).astype(np.float32)
    by_path = {"t": table, "h": head}
    ties = [("h", "t", True)]
    for grads, want in (({table.id: gt, head.id: gh}, gt + gh.T), ({table.id: gt}, gt), ({head.id: gh}, gh.T)):
        out = tie_gradients({k: op.Tensor.from_numpy(v) for k, v in grads.items()}, by_path, ties)
        np.testing.assert_array_equal(out[table.id].to_numpy(), want)
        np.testing.assert_array_equal(out[head.id].to_numpy(), want.T)
    same = op.Param(op.ParamId(), value=op.Tensor.from_numpy(t.copy()))  # a tie without transpose (Gemm transB=1)
    out = tie_gradients({table.id: op.Tensor.from_numpy(gt), same.id: op.Tensor.from_numpy(gh.T.copy())},
                        {"t": table, "h": same}, [("h", "t", False)])
    np.testing.assert_array_equal(out[table.id].to_numpy(), gt + gh.T)
    np.testing.assert_array_equal(out[same.id].to_numpy(), gt + gh.T)
    t2 = t.T.copy()
    t2[3, 299] += 1.0  # in the last, partial block
    untied = {"t": table, "h": op.Param(head.id, value=op.Tensor.from_numpy(t2))}
    out = tie_gradients({table.id: op.Tensor.from_numpy(gt), head.id: op.Tensor.from_numpy(gh)}, untied, ties)
    np.testing.assert_array_equal(out[table.id].to_numpy(), gt)
    np.testing.assert_array_equal(out[head.id].to_numpy(), gh)


class _Around(op.Module):
    """A module of the user's holding the imported model (its params at ``inner.*``)."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids)


def test_an_imported_model_inside_a_module_of_yours_trains_its_tie_as_one(tiny):
    model, imported, ids, target = tiny
    around = _Around(imported)
    model.zero_grad()
    _loss_torch(model, torch.tensor(ids), torch.tensor(target)).backward()
    _, grads = grad(_loss, around, op.Tensor.from_numpy(ids), op.Tensor.from_numpy(target))
    (head, (table, _)), = imported.onnx_ties.items()
    params = dict(around.named_params())
    want = model.wte.weight.grad.numpy()
    np.testing.assert_allclose(grads[params[f"inner.{table}"]].to_numpy(), want, rtol=RTOL, atol=RTOL * np.abs(want).max())
    np.testing.assert_allclose(grads[params[f"inner.{head}"]].to_numpy().T, want, rtol=RTOL,
                               atol=RTOL * np.abs(want).max())


@pytest.mark.slow  # one more dynamo export
def test_dynamo_without_its_optimizer_writes_the_tie_as_one_initializer_and_one_param(tmp_path):
    """``torch.onnx.export(..., dynamo=True, optimize=False)`` (the README's way around merged
    initializers) keeps the tied weight one initializer, read by ``Gather`` and ``Transpose``:
    one param, no pair to sum, and its gradient is torch's ``wte.grad``."""
    model = tiny_lm()
    ids, target = _data()
    path = tmp_path / "noopt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.tensor(ids),), str(path), input_names=["ids"], output_names=["logits"],
                          dynamo=True, optimize=False, external_data=False)
    imported = op.import_onnx(path)
    assert imported.onnx_ties == {}
    uses = {n.op_type for n in onnx.load(str(path)).graph.node if "lm_head.weight" in n.input or "wte.weight" in n.input}
    assert uses == {"Gather", "Transpose"}
    held = _check_grads(imported, model, ids, target)
    assert len(held["wte.weight"]) == 1
