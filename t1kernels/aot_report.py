"""Registers, spills and shared memory of the Triton kernels at production shapes, compiled ahead of time for a GPU
target on a machine without one.

    python -m t1kernels.aot_report [--arch 90] [--json]

How: the host functions of the kernels (`moe_fwd_triton`, `moe_bwd_triton`, `triton_logprob_fwd`/`_bwd`) run on
meta tensors of the production shapes with every Triton launch recorded instead of run (`record_launches`), so the
arguments, constexprs and launch options are exactly the ones production passes (tiles come from `moe_config` /
`logprob_triton._config` as on a GPU: this process does not set TRITON_INTERPRET). Each distinct launch is then
specialised as Triton's JIT would specialise it (integer arguments equal to 1, divisibility by 16) and compiled
with `triton.compile` for `GPUTarget("cuda", arch, 32)`; for arch 90 Triton emits sm_90a. The PTX goes through the
wheel's own ptxas with `-v` (the flags Triton's `make_cubin` uses), whose report gives registers and spill bytes;
shared memory is the compiled kernel's metadata. A spill is local-memory traffic in the inner loop: the tiles of
`moe_config` and `logprob_triton._config` are chosen so that this report shows none (tests/test_moe.py,
tests/test_logprob.py check it). Running the host code on meta tensors also shows that it reads nothing on the host.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

_PTXAS_RE = re.compile(r"Used (\d+) registers.*?")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel and the arguments production passed to it."""

    fn: JITFunction
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class KernelReport:
    """ptxas's resource report of one compiled launch."""

    kernel: str
    case: str
    constexprs: dict
    num_warps: int
    num_stages: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def line(self) -> str:
        tiles = " ".join(f"{k}={v}" for k, v in self.constexprs.items())
        return (f"{self.kernel:<26} {self.case:<26} warps={self.num_warps} stages={self.num_stages} "
                f"regs={self.registers:<3} spill={self.spill_stores}/{self.spill_loads} B  "
                f"shared={self.shared_bytes // 1024} KiB  {tiles}")


@contextmanager
def record_launches(fns: list[JITFunction]) -> Iterator[list[Launch]]:
    """Within the block, launches of these kernels are appended to the yielded list and not run."""
    launches: list[Launch] = []
    for fn in fns:
        fn.run = (lambda *args, grid, warmup, _fn=fn, **kwargs:  # noqa: ARG005 (grid unused: nothing runs)
                  launches.append(Launch(_fn, args, kwargs)))
    try:
        yield launches
    finally:
        for fn in fns:
            del fn.run


def ptxas_path(arch: int) -> str:
    """The ptxas Triton itself would use for this arch (shipped in the triton wheel)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(arch).path


def ptxas_can_run(arch: int = 90) -> str | None:
    """None when the wheel's ptxas runs here, else why not."""
    try:
        subprocess.run([ptxas_path(arch), "--version"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` on this PTX."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas_path(arch), "-lineinfo", "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(src) + ".o"],
                              capture_output=True, text=True, timeout=600, check=True)
    log = proc.stderr + proc.stdout
    regs, spills = _PTXAS_RE.search(log), _SPILL_RE.search(log)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no resource line:\n{log}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_launch(launch: Launch, *, arch: int = 90):
    """Compile one recorded launch for `arch` as the JIT would (same specialisation), -> CompiledKernel."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    opts, signature, constexprs, attrs = launch.fn._pack_args(backend, dict(launch.kwargs), bound,
                                                              specialization, options)
    return triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target, options=opts.__dict__)


def report(launch: Launch, case: str, *, arch: int = 90) -> KernelReport:
    kernel = compile_launch(launch, arch=arch)
    regs, st, ld = _ptxas_usage(kernel.asm["ptx"], arch)
    const = {p.name: v for p, v in zip(launch.fn.params, _bound_values(launch)) if p.is_constexpr}
    return KernelReport(kernel=launch.fn.__name__, case=case, constexprs=const,
                        num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages,
                        registers=regs, spill_stores=st, spill_loads=ld, shared_bytes=kernel.metadata.shared)


def _bound_values(launch: Launch) -> list:
    names = [p.name for p in launch.fn.params]
    values = dict(zip(names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k in names})
    return [values.get(n, launch.fn.params[i].default) for i, n in enumerate(names)]


def _key(launch: Launch) -> tuple:
    """What makes two launches compile to the same kernel (values of 1 and multiples of 16 specialise)."""
    def spec(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return ("t", v.dtype)
        if isinstance(v, bool) or not isinstance(v, int):
            return v
        return ("i", v == 1, v % 16 == 0, abs(v) < 2**31)
    options = tuple(sorted((k, v) for k, v in launch.kwargs.items() if k not in {p.name for p in launch.fn.params}))
    return (launch.fn.__name__, tuple(spec(v) for v in _bound_values(launch)), options)


# ---- production cases -------------------------------------------------------------------------------------------

MOE_SHAPES = {"moe-30b T=8k": (8192, 2048, 768, 128, 8), "moe-122b T=16k": (16384, 4096, 1536, 256, 8)}
LOGPROB_SHAPES = {"logprob N=64k D=2048": (65536, 2048, 151936), "logprob N=64k D=4096": (65536, 4096, 151936)}


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def moe_cases(dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, Callable[[], object]]]:
    """(case, thunk) running the MoE forward and both backwards on meta tensors of each production shape."""
    from t1kernels.moe_triton import moe_fwd_triton
    from t1kernels.moe_triton_bwd import moe_bwd_triton
    for name, (T, D, F, E, K) in MOE_SHAPES.items():
        x, w13, w2, dy = _meta(T, D, dtype=dtype), _meta(E, 2 * F, D, dtype=dtype), _meta(E, D, F, dtype=dtype), \
            _meta(T, D, dtype=dtype)
        ids, w = _meta(T, K, dtype=torch.int64), _meta(T, K, dtype=torch.float32)

        def run(x=x, w13=w13, w2=w2, dy=dy, ids=ids, w=w):
            _, saved = moe_fwd_triton(x, w13, w2, ids, w, save=True)
            moe_bwd_triton(dy, x, w13, w2, ids, w, saved=saved)
            moe_bwd_triton(dy, x, w13, w2, ids, w)  # recompute: the up kernel storing h only
        yield name, run


def logprob_cases(dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, Callable[[], object]]]:
    """(case, thunk) running the log-prob forward with and without entropy and the backward with and without an
    entropy gradient on meta tensors."""
    from t1kernels.logprob_triton import triton_logprob_bwd, triton_logprob_fwd
    for name, (N, D, V) in LOGPROB_SHAPES.items():
        h, wt, tgt = _meta(N, D, dtype=dtype), _meta(V, D, dtype=dtype), _meta(N, dtype=torch.int64)
        g = _meta(N, dtype=torch.float32)

        def run(h=h, wt=wt, tgt=tgt, g=g):
            for ent in (False, True):
                _, _, lse, mz = triton_logprob_fwd(h, wt, tgt, temperature=1.0, ignore_index=-100, with_entropy=ent)
                triton_logprob_bwd(h, wt, tgt, lse, mz, g, g if ent else None, temperature=1.0, ignore_index=-100)
        yield name, run


def kernels_of(module_names: tuple[str, ...]) -> list[JITFunction]:
    """Every launchable @triton.jit kernel (name ending in _kernel) of these modules."""
    import importlib
    out = []
    for mod_name in module_names:
        mod = importlib.import_module(mod_name)
        out += [v for k, v in vars(mod).items() if isinstance(v, JITFunction) and k.endswith("_kernel")]
    return out


_MODULES = ("t1kernels.moe_triton", "t1kernels.moe_triton_bwd", "t1kernels.logprob_triton")


def production_reports(*, arch: int = 90, which: tuple[str, ...] = ("moe", "logprob")) -> list[KernelReport]:
    """One report per distinct kernel compile that the production shapes launch (bf16)."""
    cases = []
    if "moe" in which:
        cases += list(moe_cases())
    if "logprob" in which:
        cases += list(logprob_cases())
    seen: dict[tuple, str] = {}
    todo: list[tuple[Launch, str]] = []
    for case, run in cases:
        with record_launches(kernels_of(_MODULES)) as launches:
            run()
        for launch in launches:
            key = _key(launch)
            if key not in seen:
                seen[key] = case
                todo.append((launch, case))
    return [report(launch, case, arch=arch) for launch, case in todo]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m t1kernels.aot_report", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200, sm_90a)")
    p.add_argument("--only", choices=("moe", "logprob"), help="one kernel family")
    p.add_argument("--json", action="store_true", help="one JSON object per kernel instead of a table")
    args = p.parse_args(argv)
    why = ptxas_can_run(args.arch)
    if why is not None:
        print(f"ptxas cannot run here: {why}", file=sys.stderr)
        return 2
    reports = production_reports(arch=args.arch, which=(args.only,) if args.only else ("moe", "logprob"))
    for r in reports:
        print(json.dumps({**asdict(r), "spills": r.spills}) if args.json else r.line(), flush=True)
    spilling = [r for r in reports if r.spills]
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    print(f"{len(reports)} kernels compiled for {sm_arch_from_capability(args.arch)}, {len(spilling)} spill",
          file=sys.stderr)
    return 1 if spilling else 0


if __name__ == "__main__":
    raise SystemExit(main())
