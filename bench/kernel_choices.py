"""The on-device kernels gradmon chose, timed against the alternatives the code comments name.

    python bench/kernel_choices.py [--repeats 41] [--threads N]

Each pair runs interleaved (a, b, a, b, ...) on the same tensors and reports the median time
of each and their ratio, so a load that changes during the run moves both alike. CPU only,
with torch's threads as the process has them unless ``--threads`` says (say the machine's
load beside the figures: a busy machine hurts multi-threaded kernels most). The figures go in
docs/benchmark.md, "Kernel choices", with the date and this command; the code keeps the reasons.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_overhead import GPT  # noqa: E402  (bench/ is on sys.path when a script here runs)
from gradmon.capture import kernels as K  # noqa: E402
from gradmon.capture import optimizer as O  # noqa: E402

Timed = Callable[[], object]


def pair(a: Timed, b: Timed, repeats: int) -> Tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, called in turn ``repeats`` times each (after one
    warm-up call each)."""
    a(), b()
    ta: List[float] = []
    tb: List[float] = []
    for _ in range(repeats):
        for f, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _gpt_gradients() -> List[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn_like(p) for p in GPT().parameters()]


def norm_accuracy() -> Dict[str, float]:
    """Relative error of a float32 norm of 1M Gaussian elements against the float64 norm."""
    t = torch.randn(2 ** 20, generator=torch.Generator().manual_seed(1))
    exact = t.double().norm().item()
    return {"dot": abs(torch.dot(t, t).sqrt().item() - exact) / exact,
            "vector_norm": abs(torch.linalg.vector_norm(t).item() - exact) / exact}


def cases(repeats: int) -> List[Tuple[str, str, str, float, float]]:
    """(where in the code, the choice, the alternative, seconds of each)."""
    out = []
    big = torch.randn(2 ** 20)
    out.append(("kernels._l2", "dot(t, t).sqrt()", "vector_norm(t)",
                *pair(lambda: torch.dot(big, big).sqrt(), lambda: torch.linalg.vector_norm(big), repeats)))
    act = torch.randn(8, 128, 1024)
    out.append(("kernels.activation_record", "aminmax(x)", "vector_norm(x, inf)",
                *pair(lambda: torch.aminmax(act), lambda: torch.linalg.vector_norm(act, float("inf")), repeats)))
    grads = _gpt_gradients()
    groups = K._groups(grads, [g.numel() for g in grads])
    out.append(("kernels._norms", "segment norms and dots (the GPT's gradients)", "_foreach_norm",
                *pair(lambda: [K._norms([grads[i] for i in idx], dtype, small) for (_, dtype, small), idx in groups.items()],
                      lambda: torch._foreach_norm(grads), repeats)))
    lengths = tuple([16384] * 40 + [9000])
    block = torch.randn(len(lengths), 16384)
    as_bool = K._padding_mask(lengths, torch.device("cpu"))
    as_float = K._padding_mask(lengths, torch.device("cpu"), torch.float32)
    out.append(("kernels._padding_mask", "block * float mask", "block * bool mask",
                *pair(lambda: block.mul(as_float), lambda: block.mul(as_bool), repeats)))
    held = torch.empty_like(block)
    out.append(("kernels.Scratch", "z * z into memory used before", "z * z into fresh memory",
                *pair(lambda: torch.mul(block, block, out=held), lambda: torch.mul(block, block), repeats)))
    a, b = torch.randn(64, 16384), torch.randn(64, 16384)
    out.append(("optimizer._dots", "vecdot of a block's rows", "batched matrix product",
                *pair(lambda: torch.linalg.vecdot(a, b), lambda: torch.bmm(a.unsqueeze(1), b.unsqueeze(2)), repeats)))
    flat = torch.randn(2 ** 20)
    out.append(("optimizer._dots", "dot(a, a)", "vector_norm(a)",
                *pair(lambda: torch.dot(flat, flat), lambda: torch.linalg.vector_norm(flat), repeats)))
    small = [torch.randn(256, 4) for _ in range(1000)]
    out.append(("optimizer._batches", "1000 contiguous tensors as they are", "reshape(-1) of each",
                *pair(lambda: [t for t in small], lambda: [t.reshape(-1) for t in small], repeats)))
    vectors = [torch.randn(1024) for _ in range(1000)]
    out.append(("optimizer._batches", "1000 vectors as they are", "reshape(-1) of each",
                *pair(lambda: [t if t.dim() == 1 else t.reshape(-1) for t in vectors],
                      lambda: [t.reshape(-1) for t in vectors], repeats)))
    blocks = [torch.randn(4, 8) for _ in range(1000)]
    cpu = torch.device("cpu")

    def flat_copy() -> object:  # as for outputs of several shapes: nothing stacks them
        return K.extremes_many(blocks, cpu, 4, [], stacked=False)
    out.append(("kernels._extremes_stacked", "1000 (4, 8) block outputs stacked, by rows", "one flat copy, by segment",
                *pair(lambda: K.extremes_many(blocks, cpu, 4, []), flat_copy, repeats)))
    chain_grads = [torch.randn(8, 8) if i % 2 == 0 else torch.randn(8) for i in range(2000)]

    def flat_norms() -> object:  # as for fewer than SIZE_PLAN_MIN tensors
        least, K.SIZE_PLAN_MIN = K.SIZE_PLAN_MIN, len(chain_grads) + 1
        try:
            return K._segment_norms(chain_grads)
        finally:
            K.SIZE_PLAN_MIN = least
    out.append(("kernels._size_plan", "2000 small gradients (8x8, 8) stacked by size", "one flat copy, by segment",
                *pair(lambda: K._segment_norms(chain_grads), flat_norms, repeats)))
    out.append(_chunks(max(3, repeats // 8)))
    return out


def _chunks(repeats: int) -> Tuple[str, str, str, float, float]:
    """The optimizer read of whole parameters (sample 0) in batches of CHUNK elements against
    batches three times larger, on Adam's state for four 2048x2048 weights."""
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(2048, 2048)) for _ in range(4)]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    home = torch.device("cpu")
    chosen = O.CHUNK

    def read(chunk: int) -> Timed:
        def run() -> object:
            O.CHUNK = chunk
            try:
                return O.read(opt, params, home, 0)
            finally:
                O.CHUNK = chosen
        return run

    return ("optimizer.CHUNK", f"batches of {chosen} elements", f"batches of {3 * chosen}",
            *pair(read(chosen), read(3 * chosen), repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: as the process has it)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| where | chosen | alternative | chosen (ms) | alternative (ms) | alternative / chosen |")
    print("|---|---|---|---:|---:|---:|")
    for where, chosen, other, ta, tb in cases(args.repeats):
        print(f"| `{where}` | {chosen} | {other} | {ta * 1e3:.3f} | {tb * 1e3:.3f} | {tb / ta:.2f} |")
    acc = norm_accuracy()
    print(f"\nfloat32 norm of 1M Gaussian elements, relative error against float64: dot {acc['dot']:.1e}, "
          f"vector_norm {acc['vector_norm']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
