"""Record the allocation traces graphpool ships, from real programs on a GPU.

    python benchmarks/record_traces.py [--out DIR] [--quick] [--max-events N] [--only NAME ...]

Four programs of different kinds, each recorded after a warm-up (so one-time set-up such
as optimizer state, cuBLAS/cuDNN workspaces and cuFFT plans stays out of the trace):

* ``torch-transformer-train``: training steps of a small language model
  (``torch.nn.TransformerEncoder``, d_model 512, 6 layers, batch 16 x seq 256, AdamW);
* ``torch-resnet-train``: training steps of a ResNet-like convolutional net written out
  with ``torch.nn`` (batch 32 of 3x224x224, SGD with momentum);
* ``torch-transformer-infer``: inference (``torch.no_grad``, eval mode) of a transformer
  over calls of varied batch and sequence length;
* ``cupy-fft-matmul``: a CuPy program on two streams (FFT low-pass filtering, elementwise
  work and reductions on one; matrix products and reductions on the other) over a few
  array sizes.

PyTorch's programs are recorded with ``torch.cuda.memory._record_memory_history`` and
``_snapshot()`` and converted by ``graphpool.traces.from_torch_snapshot``; CuPy's through
``graphpool.traces.RecordingAllocator``. Each trace is cut to ``--max-events`` events and
written to DIR (default: ``src/graphpool/tools/trace_data``, the package data) as
``<name>.json.gz``; a summary line per trace goes to stdout. A recording that fails prints
its error and the others go on; the exit status is 1 if any failed. ``--quick``: small
shapes and one step each, written to a scratch directory unless ``--out`` is given (a
smoke test of this script, not traces to ship). Needs torch and/or cupy, and a GPU; no
network.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "src" / "graphpool" / "tools" / "trace_data"
MAX_EVENTS = 50_000
HISTORY_ENTRIES = 1_000_000  # PyTorch's history ring; a recording that fills it is refused


def _traces() -> Any:
    """graphpool.traces from this checkout (its src/ first), else the installed one."""
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from graphpool.tools import traces

    return traces


def _today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


# ----------------------------------------------------------------------------- PyTorch
def _torch_facts(program: str) -> dict[str, str]:
    import torch

    return {
        "program": program,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "gpu": torch.cuda.get_device_name(),
        "date": _today(),
        "recorded by": "benchmarks/record_traces.py",
    }


def _record_torch(run: Callable[[], None]) -> tuple[dict[str, Any], int]:
    """Run ``run`` with PyTorch's allocator history on; its snapshot (the device trace cut to
    what ``run`` did) and the device index."""
    import inspect

    import torch

    memory = torch.cuda.memory
    device = torch.cuda.current_device()
    params = inspect.signature(memory._record_memory_history).parameters
    kwargs: dict[str, Any] = {"max_entries": HISTORY_ENTRIES}
    if "context" in params:
        kwargs["context"] = None  # no stack traces: less overhead, and the trace needs none
    if "stacks" in params:
        kwargs["stacks"] = "python"
    if "clear_history" in params:
        kwargs["clear_history"] = True
    torch.cuda.synchronize()
    memory._record_memory_history(enabled="all", **kwargs)
    try:
        before = len(memory._snapshot()["device_traces"][device])  # whatever history survived
        run()
        torch.cuda.synchronize()
        snap = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    entries = snap["device_traces"][device]
    if len(entries) >= HISTORY_ENTRIES:
        raise RuntimeError(f"the history filled its {HISTORY_ENTRIES} entries: record fewer steps")
    snap["device_traces"][device] = entries[before:]
    return snap, device


def _from_torch(name: str, run: Callable[[], None], description: str, facts: dict[str, str]) -> Any:
    traces = _traces()
    snap, device = _record_torch(run)
    how = (
        f" Recorded on {facts['gpu']} (PyTorch {facts['torch']}, CUDA {facts['cuda']}) on {facts['date']} "
        "with torch.cuda.memory._record_memory_history and _snapshot(), after one warm-up; "
        "converted by graphpool.traces.from_torch_snapshot."
    )
    return traces.from_torch_snapshot(
        snap, device=device, name=name, description=description + how, info=facts
    )


class _LanguageModel:
    """Embedding, TransformerEncoder, a linear head to the vocabulary."""

    def __init__(self, d_model: int, layers: int, vocab: int) -> None:
        from torch import nn

        layer = nn.TransformerEncoderLayer(
            d_model, nhead=8, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True
        )
        self.modules = nn.ModuleDict(
            {
                "embed": nn.Embedding(vocab, d_model),
                "encoder": nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False),
                "head": nn.Linear(d_model, vocab),
            }
        ).cuda()
        self.vocab = vocab

    def __call__(self, tokens: Any) -> Any:
        m = self.modules
        return m["head"](m["encoder"](m["embed"](tokens)))


def record_transformer_train(quick: bool) -> Any:
    """Training steps of a small transformer language model (AdamW, cross-entropy)."""
    import torch

    torch.manual_seed(0)
    d_model, layers, batch, seq, vocab, steps = (
        (128, 2, 4, 64, 1024, 1) if quick else (512, 6, 16, 256, 8192, 3)
    )
    model = _LanguageModel(d_model, layers, vocab)
    opt = torch.optim.AdamW(model.modules.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = loss_fn(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()

    model.modules.train()
    step()  # warm-up: optimizer state, cuBLAS workspace
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(steps):
            step()

    program = (
        f"torch.nn.TransformerEncoder language model, d_model {d_model}, 8 heads, {layers} layers, "
        f"vocabulary {vocab}, batch {batch} x seq {seq}, AdamW, cross-entropy: {steps} training step(s)"
    )
    return _from_torch("torch-transformer-train", run, program + ".", _torch_facts(program))


def _resnet(width: int, classes: int) -> Any:
    """A ResNet-18-like net: a 7x7 stem, four stages of two basic blocks, pooling, a linear head."""
    from torch import nn

    class Basic(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                nn.BatchNorm2d(cout),
            )
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.skip(x))

    stages = []
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        stages += [Basic(cin, cout, 1 if i == 0 else 2), Basic(cout, cout, 1)]
        cin = cout
    return nn.Sequential(
        nn.Conv2d(3, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(cin, classes),
    ).cuda()


def record_resnet_train(quick: bool) -> Any:
    """Training steps of a ResNet-like convolutional net (SGD with momentum)."""
    import torch

    torch.manual_seed(0)
    batch, side, width, steps = (8, 64, 16, 1) if quick else (32, 224, 64, 3)
    net = _resnet(width, 1000)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        images = torch.randn(batch, 3, side, side, device="cuda")
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(images), labels)
        loss.backward()
        opt.step()

    net.train()
    step()  # warm-up: momentum buffers, cuDNN workspaces
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(steps):
            step()

    program = (
        f"ResNet-18-like convolutional net (width {width}, torch.nn), batch {batch} of 3x{side}x{side}, "
        f"SGD momentum 0.9, cross-entropy: {steps} training step(s)"
    )
    return _from_torch("torch-resnet-train", run, program + ".", _torch_facts(program))


def record_transformer_infer(quick: bool) -> Any:
    """Inference of a transformer over calls of varied batch and sequence length."""
    import torch

    torch.manual_seed(0)
    d_model, layers, vocab = (128, 2, 1024) if quick else (512, 6, 8192)
    shapes = [(1, 128), (8, 256), (4, 64), (16, 128), (2, 512), (1, 1024), (32, 32), (8, 384)]
    if quick:
        shapes = [(1, 32), (4, 64), (2, 16)]
    model = _LanguageModel(d_model, layers, vocab)
    model.modules.eval()

    def call(batch: int, seq: int) -> None:
        tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
        logits = model(tokens)
        logits.argmax(-1)  # the next tokens: the result a server would keep

    with torch.no_grad():
        for b, s in shapes:  # warm-up: every shape once
            call(b, s)
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(1 if quick else 2):
                for b, s in shapes:
                    call(b, s)

        program = (
            f"torch.nn.TransformerEncoder language model inference (eval, no_grad), d_model {d_model}, "
            f"{layers} layers, vocabulary {vocab}, calls of (batch, seq) "
            + ", ".join(f"{b}x{s}" for b, s in shapes)
            + (", once" if quick else ", twice")
        )
        return _from_torch("torch-transformer-infer", run, program + ".", _torch_facts(program))


# ----------------------------------------------------------------------------- CuPy
def record_cupy(quick: bool) -> Any:
    """A CuPy program on two streams: FFT filtering and elementwise work and reductions on one,
    matrix products and reductions on the other, over a few sizes."""
    import cupy as cp

    traces = _traces()
    sizes = (
        [(1 << 14, 128), (1 << 16, 256)]
        if quick
        else [(1 << 16, 256), (1 << 20, 512), (3_000_000, 1024), (1 << 23, 2048)]
    )
    signal = cp.cuda.Stream(non_blocking=True)
    dense = cp.cuda.Stream(non_blocking=True)

    results: list[float] = []  # read back, as a program would (and a sync per size)

    def work(n: int, m: int) -> None:
        with signal:
            x = cp.random.standard_normal(n, dtype=cp.float32)
            spectrum = cp.fft.rfft(x)
            spectrum *= cp.exp(-((cp.fft.rfftfreq(n) / 0.05) ** 2)).astype(cp.float32)
            y = cp.fft.irfft(spectrum, n)
            z = cp.sqrt(y * y + 1.0) - cp.tanh(y)
            results.extend((float(z.sum()), float(y.std()), float(cp.abs(y).max())))
        with dense:
            a = cp.random.standard_normal((m, m), dtype=cp.float32)
            b = cp.random.standard_normal((m, m), dtype=cp.float32)
            c = cp.maximum(a @ b, 0)
            norms = cp.linalg.norm(c, axis=1)
            top = cp.argsort(norms)[-10:]
            results.append(float((c[top] @ b[:, :16]).mean()))

    for n, m in sizes:  # warm-up: kernels compiled, FFT plans and cuBLAS handles made
        work(n, m)
    cp.cuda.Device().synchronize()
    rec = traces.RecordingAllocator()
    repeats = 1 if quick else 3
    with rec:
        for _ in range(repeats):
            for n, m in sizes:
                work(n, m)
        cp.cuda.Device().synchronize()
    rec.pool.free_all_blocks()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rt_version = cp.cuda.runtime.runtimeGetVersion()
    program = (
        "CuPy on two non-blocking streams: rfft low-pass filter, elementwise and reductions on one; "
        "matmul, norms, argsort on the other; sizes (n, m) "
        + ", ".join(f"({n}, {m})" for n, m in sizes)
        + f", {repeats} pass(es)"
    )
    facts = {
        "program": program,
        "cupy": cp.__version__,
        "cuda runtime": str(rt_version),
        "gpu": gpu,
        "date": _today(),
        "recorded by": "benchmarks/record_traces.py",
    }
    how = (
        f". Recorded on {gpu} (CuPy {cp.__version__}, CUDA runtime {rt_version}) on {facts['date']} through "
        "graphpool.traces.RecordingAllocator (a cupy PythonFunctionAllocator over a MemoryPool), "
        "after one warm-up."
    )
    return rec.trace("cupy-fft-matmul", program + how, facts)


RECORDINGS: dict[str, Callable[[bool], Any]] = {
    "torch-transformer-train": record_transformer_train,
    "torch-resnet-train": record_resnet_train,
    "torch-transformer-infer": record_transformer_infer,
    "cupy-fft-matmul": record_cupy,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Record allocation traces of real programs (PyTorch, CuPy) on a GPU "
        "into graphpool's trace data.",
        epilog="Programs: " + ", ".join(RECORDINGS),
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"directory to write <name>.json.gz into (default: {DEFAULT_OUT}; "
        "with --quick a scratch directory)",
    )
    p.add_argument("--quick", action="store_true", help="small shapes, one step each (a smoke test)")
    p.add_argument(
        "--max-events",
        type=int,
        default=MAX_EVENTS,
        help=f"cut each trace to this many events (default {MAX_EVENTS})",
    )
    p.add_argument(
        "--only", nargs="+", choices=list(RECORDINGS), metavar="NAME", help="record only these programs"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out or (
        Path(tempfile.mkdtemp(prefix="graphpool-traces-quick-")) if args.quick else DEFAULT_OUT
    )
    out.mkdir(parents=True, exist_ok=True)
    traces = _traces()
    failed = []
    for name in args.only or list(RECORDINGS):
        t0 = time.perf_counter()
        print(f"recording {name} ...", flush=True)
        try:
            trace = traces.truncated(RECORDINGS[name](args.quick), args.max_events)
            path = out / f"{trace.name}.json.gz"
            traces.save(trace, path)
        except Exception:
            traceback.print_exc()
            print(f"  {name}: FAILED (see the error above); going on", flush=True)
            failed.append(name)
            continue
        s = traces.summary(trace)
        print(
            f"  {name}: {s['events']} events ({s['allocations']} allocations, "
            f"{s['live at the end']} live at the end), "
            f"peak live {s['peak live bytes'] / 2**20:,.1f} MiB, {s['distinct sizes']} distinct sizes, "
            f"{s['streams']} stream(s); {path} ({path.stat().st_size / 1024:,.0f} KiB), "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        if "truncated" in trace.info:
            print(f"  {name}: {trace.info['truncated']}", flush=True)
    print(f"written to {out}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
