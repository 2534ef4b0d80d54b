"""The ``train`` section's imported models: BERT-tiny and ResNet18 fine-tuning steps, onnxparam vs
PyTorch eager (``python tools/bench.py train``).

Each model is built in PyTorch with random weights (``torch.manual_seed``), exported by torch's
TorchScript exporter (opset 17, dynamic batch and sequence / spatial dims, eval mode) into a
temporary folder and imported with :func:`onnxparam.import_onnx`. One fine-tuning step is
``grad(loss_fn, module, x, y)`` + ``Adam.step(..., in_place=True)`` for onnxparam (the loop writes each
step's new weights into the arrays the optimizer made at the step before; value semantics would
hold a second copy of the weights during the step) and ``zero_grad`` + forward +
``loss.backward()`` + ``torch.optim.Adam.step`` for the same torch model (same weights and inputs,
eval mode: no dropout, BatchNorm's inference form, as exported), both sides updating every param.

* time: the two steps interleaved in one process (:func:`bench.interleaved_medians`), ratio of
  medians, one thread a side unless ``--threads`` is given (ONNX Runtime without spinning);
  target :data:`TIME_TARGET`;
* memory: each side in a fresh child process (``python tools/bench_train.py --child MODEL SIDE``):
  the RSS growth from "model loaded (params read), inputs and optimizer made" to the peak of the
  :data:`MEMORY_STEPS` steps after the first (``VmHWM``, reset after the first step, - ``VmRSS``
  before it: what the loop keeps — activations, gradients, optimizer state and, for onnxparam,
  the training session and graph — plus a step's transients; the first step's own transients,
  tracing and building, are not counted); target
  :data:`MEMORY_TARGET`. The onnxparam step with value semantics (``Adam.step`` without
  ``in_place``) is measured too and printed beside it. With ``recompute`` (in place too) the
  imported model's encoder layers / residual stages are marked for recomputation
  (:func:`onnxparam.autodiff.recompute`) and measured too;
* sessions: the imported BERT trained at three batch sizes (and sequence lengths) builds
  :data:`SESSION_TARGET` training session (counted by :func:`onnxparam.runtime.stats`).

ResNet18 is torchvision's ``resnet18`` when torchvision is installed, else the same architecture
written here (:func:`_resnet18`: BasicBlocks [2, 2, 2, 2], 64..512 channels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

TIME_TARGET = 1.0
MEMORY_TARGET = 1.3
SESSION_TARGET = 1
MEMORY_STEPS = 3

BERT = dict(vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
            max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
"""``prajjwal1/bert-tiny``'s configuration (random weights), dropout off (eval-mode export)."""
BERT_BATCH, BERT_SEQ, BERT_CLASSES = 8, 128, 2
RESNET_BATCH, RESNET_SIZE, RESNET_CLASSES = 8, 64, 10
RECOMPUTED = {"bert": ("bert.encoder.layer.0", "bert.encoder.layer.1"), "resnet18": ("layer1", "layer2", "layer3", "layer4")}
"""The sub-modules marked for recomputation in the ``recompute`` memory runs."""
SESSION_SHAPES = [(4, 32), (8, 64), (2, 48)]
"""``(batch, sequence)`` of the session-count run."""

CHILD_FLAG = "--child"
SIDE_NAMES = {"ours": "onnxparam (in_place=True)", "value": "onnxparam (value semantics)", "torch": "torch",
              "recompute": "onnxparam with recompute"}


# -- the torch models ---------------------------------------------------------------------------

def _torch_bert():
    import torch
    import transformers

    class Classifier(torch.nn.Module):
        """BertModel + a linear head on the first token: logits ``[batch, classes]``."""

        def __init__(self):
            super().__init__()
            self.bert = transformers.BertModel(transformers.BertConfig(**BERT), add_pooling_layer=False)
            self.head = torch.nn.Linear(BERT["hidden_size"], BERT_CLASSES)

        def forward(self, ids):
            return self.head(self.bert(input_ids=ids).last_hidden_state[:, 0])

    torch.manual_seed(0)
    return Classifier().eval()


def _resnet18():
    """torchvision's ResNet18 (``num_classes`` :data:`RESNET_CLASSES`), or the same architecture."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    try:
        import torchvision

        return torchvision.models.resnet18(num_classes=RESNET_CLASSES).eval()
    except ImportError:
        pass

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            widths, cin = [64, 128, 256, 512], 64
            for i, w in enumerate(widths):
                stride = 1 if i == 0 else 2
                setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
                cin = w
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, RESNET_CLASSES)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet18().eval()


MODELS = {"bert": _torch_bert, "resnet18": _resnet18}


def _inputs(name: str, batch: int = 0, seq: int = 0):
    rng = np.random.default_rng(1)
    if name == "bert":
        batch, seq = batch or BERT_BATCH, seq or BERT_SEQ
        return (rng.integers(1, BERT["vocab_size"], (batch, seq)).astype(np.int64),
                rng.integers(0, BERT_CLASSES, (batch,)).astype(np.int64))
    batch = batch or RESNET_BATCH
    return (rng.normal(size=(batch, 3, RESNET_SIZE, RESNET_SIZE)).astype(np.float32),
            rng.integers(0, RESNET_CLASSES, (batch,)).astype(np.int64))


def export(name: str, folder: Path) -> Path:
    """The torch model ``name`` exported to ``folder/<name>.onnx`` (made once)."""
    import torch

    path = Path(folder) / f"{name}.onnx"
    if path.exists():
        return path
    model = MODELS[name]()
    x, _ = _inputs(name, 2, 16)
    axes = {"x": {0: "batch", 1: "seq"}} if name == "bert" else {"x": {0: "batch", 2: "height", 3: "width"}}
    axes["logits"] = {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(x),), str(path), input_names=["x"], output_names=["logits"],
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    return path


# -- the steps ----------------------------------------------------------------------------------

def _loss_fn(m, x, y):
    from onnxparam.autodiff import cross_entropy

    return cross_entropy(m(x=x), y)


def ours_step(path: Path, name: str, threads: int = 0, recompute: bool = False, in_place: bool = True):
    """``step()`` (one onnxparam fine-tuning step) on the imported model at ``path``; ``in_place``:
    ``Adam.step(..., in_place=True)`` (else value semantics: a new array per param and step)."""
    import onnxparam as op
    from onnxparam import runtime
    from onnxparam.autodiff import grad
    from onnxparam.optim import Adam

    module = op.import_onnx(path)
    for _, param in module.named_params():  # NOTE: read now (the import maps the file), as torch's are in memory
        np.asarray(param.val().to_numpy()).sum()
    # NOTE: ONNX Runtime's pool threads spin after each run by default, taking the cores from the torch
    # step timed next to it (torch looked 2-4x slower than alone); no spinning keeps the comparison fair
    runtime.set_session_config(module, runtime.SessionConfig(
        intra_op_num_threads=threads, config_entries=(("session.intra_op.allow_spinning", "0"),)))
    if recompute:
        from onnxparam.autodiff import recompute as mark

        module = mark(module, *RECOMPUTED[name])
    x, y = _inputs(name)
    state = {"model": module, "optim": Adam(lr=1e-4, eps=1e-8)}

    def step():
        _, grads = grad(_loss_fn, state["model"], x, y)
        state["model"] = state["optim"].step(state["model"], grads, in_place=in_place)

    return step


def torch_step(name: str, threads: int = 0):
    """``step()`` (one eager PyTorch fine-tuning step) on the same model and inputs."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    model = MODELS[name]()
    x, y = (torch.from_numpy(a) for a in _inputs(name))
    optim = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-8)

    def step():
        optim.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optim.step()

    return step


# -- memory (child processes) -------------------------------------------------------------------

def _status_kib() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM", "RssAnon")}


def _child(name: str, side: str, folder: str, threads: int) -> int:
    """One side's steps in this fresh process; prints a JSON line: RSS before the first step and
    the peak over :data:`MEMORY_STEPS` steps (KiB)."""
    if side == "torch":
        step = torch_step(name, threads)
    else:
        step = ours_step(Path(folder) / f"{name}.onnx", name, threads, recompute=side == "recompute",
                         in_place=side != "value")
    before = _status_kib()
    step()  # NOTE: the first step traces and builds (onnxparam) or allocates the optimizer state (torch)
    first = _status_kib()
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    for _ in range(MEMORY_STEPS):
        step()
    after = _status_kib()
    print(json.dumps({"before": before["VmRSS"], "first_peak": first["VmHWM"], "peak": after["VmHWM"],
                      "anon_before": before["RssAnon"], "anon_after": after["RssAnon"]}))
    return 0


def _child_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def child_memory(name: str, side: str, folder: Path, threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, CHILD_FLAG, name, side, str(folder), str(threads)],
                         capture_output=True, text=True, env=_child_env())
    if out.returncode:
        raise RuntimeError(f"bench_train child {name} {side} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the section --------------------------------------------------------------------------------

def sessions_for_three_batch_sizes(path: Path) -> int:
    """Training sessions built while the imported BERT trains at :data:`SESSION_SHAPES`."""
    import onnxparam as op
    from onnxparam import runtime
    from onnxparam.autodiff import grad

    module = op.import_onnx(path)
    before = runtime.stats().training_sessions_built
    for batch, seq in SESSION_SHAPES:
        grad(_loss_fn, module, *_inputs("bert", batch, seq))
    return runtime.stats().training_sessions_built - before


def run(args, Result, interleaved_medians) -> list:
    """The imported-model cases of ``bench.py train`` (``Result`` and ``interleaved_medians``
    from ``bench.py``)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("train: torch / transformers not installed; skipped the imported BERT-tiny / ResNet18 cases")
        return []
    from onnxparam import autodiff

    repeats = max(args.repeats // 50, 10)
    # NOTE: one thread a side unless --threads says otherwise: with their default pools both sides
    # degrade under a shared machine's load very unevenly (torch's 2-thread step 5x its 1-thread
    # one at load 12 here, while ONNX Runtime's barely moved), which measures the load, not the step
    threads = args.threads or 1
    sides = ("ours", "value", "torch") + (("recompute",) if hasattr(autodiff, "recompute") else ())
    results = []
    with tempfile.TemporaryDirectory(prefix="onnxparam-bench-train-") as tmp:
        folder = Path(tmp)
        for name in MODELS:
            path = export(name, folder)
            t_ours, t_base = interleaved_medians(ours_step(path, name, threads), torch_step(name, threads),
                                                 repeats, warmup=2)
            label = "bert-tiny" if name == "bert" else "resnet18"
            shape = f"{BERT_BATCH}x{BERT_SEQ}" if name == "bert" else f"{RESNET_BATCH}x3x{RESNET_SIZE}x{RESNET_SIZE}"
            results.append(Result("train", f"{label} step {shape}", t_ours, t_base, TIME_TARGET))
            mem = {side: child_memory(name, side, folder, threads) for side in sides}
            grow = {side: (m["peak"] - m["before"]) * 1024.0 for side, m in mem.items()}
            shown = ", ".join(f"{SIDE_NAMES[side]} {grow[side] / 2**20:.0f} MiB (process peak {mem[side]['peak'] / 1024:.0f} MiB)"
                              for side in sides)
            print(f"train: {label} RSS growth to the peak of steps 2-{MEMORY_STEPS + 1}: {shown}")
            print(f"train: {label} RSS ratio vs torch: in_place=True {grow['ours'] / grow['torch']:.2f}, "
                  f"value semantics {grow['value'] / grow['torch']:.2f} (the time above: in_place=True)")
            results.append(Result("train", f"{label} step RSS", grow["ours"], grow["torch"], MEMORY_TARGET, unit="MiB"))
            if "recompute" in grow:
                results.append(Result("train", f"{label} RSS recompute", grow["recompute"], grow["torch"],
                                      MEMORY_TARGET, unit="MiB"))
        built = sessions_for_three_batch_sizes(export("bert", folder))
        print(f"train: imported bert-tiny at {len(SESSION_SHAPES)} (batch, seq) shapes {SESSION_SHAPES}: "
              f"{built} training session(s) built")
        results.append(Result("train", "bert sessions/3 batches", built, SESSION_TARGET, 1.0, unit="count"))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == CHILD_FLAG:
        sys.exit(_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    sys.exit("usage: run through tools/bench.py train")
