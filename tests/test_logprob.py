"""token_logprobs against a float64 materialising reference (log_softmax + gather), on the CPU path and in the
Triton interpreter; input validation; the CPU memory bound.

The interpreter and the memory measurement run in fresh subprocesses of this file (`--interpreter`,
`--memory`): TRITON_INTERPRET must be set before triton is imported, and peak RSS is per process.
Interpreter shapes are small (V = 1000 / 3001, N <= 37): it runs programs one at a time in numpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from t1kernels import logprob_torch
from t1kernels.logprob import token_logprobs
from t1kernels.logprob_torch import N_CHUNK, fits_one_tile, reference_token_logprobs, vocab_chunk
from tests.aot import aot_rows

ROOT = Path(__file__).resolve().parents[1]
# fp32 accumulation over D and over ~1e5 vocabulary columns against float64. Values: ~1e-6 relative. Gradients
# sum V terms of both signs (d_hidden is a GEMM with inner size V), so their error follows the BLAS's summation
# order: ~1e-6 on the earlier boxes, up to 1.06e-4 of the largest entry at V=151,936 and temperature 1.3 with MKL's
# AVX2 kernels on an AMD EPYC (2026-12-02). 3e-4 covers both and still catches any wrong term (those are O(1)).
VAL_TOL = 1e-4
GRAD_TOL = 3e-4


def _problem(N: int, D: int, V: int, *, seed: int, ignore_rows: tuple[int, ...] = (1,), scale: float = 1.0,
             dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, D, generator=g) * scale).to(dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5 * 4).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[r for r in ignore_rows if r < N]] = -100
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, targets, g_logp, g_ent


def _grads(fn, hidden, weight, targets, g_logp, g_ent, temperature, **kw):
    """(logp, entropy, d_hidden, d_weight) of fn for the loss sum(g_logp * logp + g_ent * entropy)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = fn(h, w, targets, temperature=temperature, **kw)
    (logp * g_logp.to(logp.dtype)).sum().add((ent * g_ent.to(ent.dtype)).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _check_against_reference(hidden, weight, targets, g_logp, g_ent, temperature, *, val_tol=VAL_TOL,
                             grad_tol=GRAD_TOL) -> None:
    lp, en, gh, gw = _grads(token_logprobs, hidden, weight, targets, g_logp, g_ent, temperature,
                            return_entropy=True)
    rlp, ren, rgh, rgw = _grads(reference_token_logprobs, hidden, weight, targets, g_logp, g_ent, temperature,
                                dtype=torch.float64)
    assert lp.dtype == en.dtype == torch.float32
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    assert float(((lp.double() - rlp).abs() / (1 + rlp.abs())).max()) < val_tol
    assert float(((en.double() - ren).abs() / (1 + ren.abs())).max()) < val_tol
    assert _rel(gh, rgh) < grad_tol, _rel(gh, rgh)
    assert _rel(gw, rgw) < grad_tol, _rel(gw, rgw)


@pytest.mark.parametrize("V", [50_257, 151_936])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
def test_cpu_matches_float64_reference(V: int, temperature: float) -> None:
    hidden, weight, targets, g_logp, g_ent = _problem(6, 16, V, seed=V + int(temperature * 10), scale=2.0)
    _check_against_reference(hidden, weight, targets, g_logp, g_ent, temperature)


def test_cpu_multiple_row_and_vocab_chunks() -> None:
    # More rows than N_CHUNK and a vocabulary that ends mid-chunk: both loops take a ragged last step.
    V = 2 * vocab_chunk(N_CHUNK, 10**9) + 5
    hidden, weight, targets, g_logp, g_ent = _problem(N_CHUNK + 37, 8, V, seed=3, ignore_rows=(1, N_CHUNK + 3))
    _check_against_reference(hidden, weight, targets, g_logp, g_ent, 0.9)


@pytest.fixture(params=["tile", "chunked"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test through both CPU paths: "tile" keeps the whole [N, V] (N * V <= 2**23, as the shapes used
    here) from forward to backward; "chunked" shrinks the tile budget so the same shapes take several row and
    vocabulary blocks (ragged ends) with recompute in the backward."""
    if request.param == "chunked":
        monkeypatch.setattr(logprob_torch, "N_CHUNK", 4)
        monkeypatch.setattr(logprob_torch, "TILE_ELEMS", 4 * 1000)
    return request.param


def test_single_tile_and_chunked_paths_match_reference(cpu_path: str) -> None:
    N, V = 70, 3001
    assert fits_one_tile(N, V) == (cpu_path == "tile")
    hidden, weight, targets, g_logp, g_ent = _problem(N, 24, V, seed=12, ignore_rows=(1, 40), scale=2.0)
    _check_against_reference(hidden, weight, targets, g_logp, g_ent, 0.8)
    first = _grads(token_logprobs, hidden, weight, targets, g_logp, g_ent, 0.8, return_entropy=True)
    second = _grads(token_logprobs, hidden, weight, targets, g_logp, g_ent, 0.8, return_entropy=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_reused_tile_buffers_keep_graphs_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    # The single-tile path hands its CPU buffer to the next forward once a backward is done with it. Graphs alive
    # at once must still get distinct buffers, a no-grad forward in between must not take a held one, and results
    # must equal those of each problem computed alone.
    pool = logprob_torch.TileBuffers()
    monkeypatch.setattr(logprob_torch, "TILE_BUFFERS", pool)
    monkeypatch.setattr(logprob_torch.TileBuffers, "REUSE_MIN_ELEMS", 1)
    problems = [_problem(40, 16, 997, seed=s) for s in (20, 21, 22)]

    def start(p):
        h, w = p[0].detach().clone().requires_grad_(), p[1].detach().clone().requires_grad_()
        return h, w, token_logprobs(h, w, p[2])

    def finish(run, p):
        h, w, logp = run
        (logp * p[3]).sum().backward()
        return logp.detach(), h.grad, w.grad

    def tile_ptr(run) -> int:
        return run[2].grad_fn.saved_tensors[3].data_ptr()  # saved: hidden, weight, targets, log-softmax tile

    alone = [finish(start(p), p) for p in problems]
    a, b = start(problems[0]), start(problems[1])
    assert tile_ptr(a) != tile_ptr(b)
    with torch.no_grad():
        logp_free = token_logprobs(*problems[2][:3])
    assert torch.equal(logp_free, alone[2][0])
    assert pool._idle[torch.device("cpu")].data_ptr() not in (tile_ptr(a), tile_ptr(b))
    for run, p, ref in ((b, problems[1], alone[1]), (a, problems[0], alone[0])):
        assert all(torch.equal(x, y) for x, y in zip(finish(run, p), ref))
    idle_ptr = pool._idle[torch.device("cpu")].data_ptr()
    assert tile_ptr(start(problems[2])) == idle_ptr  # reused, not allocated anew


def test_second_backward_through_one_graph_raises() -> None:
    # The single-tile backward writes dz over its saved log-softmax; a retained graph must not reuse it.
    h = torch.randn(4, 8, requires_grad=True)
    logp = token_logprobs(h, torch.randn(16, 8), torch.tensor([0, 3, 5, 15]))
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        logp.sum().backward()


def test_cpu_bf16_inputs_give_bf16_grads() -> None:
    hidden, weight, targets, g_logp, g_ent = _problem(5, 32, 3000, seed=4, dtype=torch.bfloat16)
    # The CPU path upcasts to fp32; the reference sees the same bf16 values in float64. Only the final
    # cast of the gradients to bf16 (8 bits of mantissa) separates them.
    _check_against_reference(hidden, weight, targets, g_logp, g_ent, 1.0, grad_tol=1e-2)


def test_logp_only_and_entropy_only_gradients(cpu_path: str) -> None:
    hidden, weight, targets, g_logp, g_ent = _problem(7, 12, 5000, seed=5)
    ref_lp, ref_en, _, _ = _grads(reference_token_logprobs, hidden, weight, targets, g_logp, g_ent, 1.0,
                                  dtype=torch.float64)
    for use_logp in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        hr = hidden.double().requires_grad_()
        wr = weight.double().requires_grad_()
        rl, re = reference_token_logprobs(hr, wr, targets)
        if use_logp:  # return_entropy=False: a single output, no entropy work
            (token_logprobs(h, w, targets) * g_logp).sum().backward()
            (rl * g_logp.double()).sum().backward()
        else:         # entropy drives the loss alone: the logp output's gradient is None
            _, en = token_logprobs(h, w, targets, return_entropy=True)
            (en * g_ent).sum().backward()
            (re * g_ent.double()).sum().backward()
        assert _rel(h.grad, hr.grad) < GRAD_TOL and _rel(w.grad, wr.grad) < GRAD_TOL


def test_ignore_index_rows_are_zero_without_gradient() -> None:
    hidden, weight, targets, g_logp, g_ent = _problem(6, 8, 777, seed=6, ignore_rows=())
    targets[[0, 4]] = 3  # a custom ignore_index that is also a valid ID elsewhere
    h = hidden.clone().requires_grad_()
    lp, en = token_logprobs(h, weight, targets, return_entropy=True, ignore_index=3)
    (lp * g_logp + en * g_ent).sum().backward()
    assert lp[[0, 4]].eq(0).all() and en[[0, 4]].eq(0).all()
    assert h.grad[[0, 4]].eq(0).all() and h.grad[[1, 2, 3, 5]].abs().amax(1).gt(0).all()
    h2 = hidden.clone().requires_grad_()
    w2 = weight.clone().requires_grad_()
    all_ignored = torch.full((6,), -100)
    lp2, en2 = token_logprobs(h2, w2, all_ignored, return_entropy=True)
    (lp2.sum() + en2.sum()).backward()
    assert lp2.eq(0).all() and en2.eq(0).all() and h2.grad.eq(0).all() and w2.grad.eq(0).all()


def test_single_column_vocab_and_empty_batch() -> None:
    lp, en = token_logprobs(torch.randn(3, 4), torch.randn(1, 4), torch.zeros(3, dtype=torch.long),
                            return_entropy=True)
    assert lp.abs().max() < 1e-6 and en.abs().max() < 1e-6
    h = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    out = token_logprobs(h, w, torch.zeros(0, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0,) and w.grad.eq(0).all()


def test_deterministic_bitwise() -> None:
    V = vocab_chunk(N_CHUNK, 10**9) + 100
    hidden, weight, targets, g_logp, g_ent = _problem(N_CHUNK + 3, 16, V, seed=7)
    first = _grads(token_logprobs, hidden, weight, targets, g_logp, g_ent, 0.7, return_entropy=True)
    second = _grads(token_logprobs, hidden, weight, targets, g_logp, g_ent, 0.7, return_entropy=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("kwargs, arg", [
    (dict(targets=torch.tensor([0, 10])), "targets"),          # == V
    (dict(targets=torch.tensor([0, -1])), "targets"),          # negative, not ignore_index
    (dict(targets=torch.tensor([0.0, 1.0])), "targets"),       # float IDs
    (dict(targets=torch.tensor([0, 1, 2])), "targets"),        # length != N
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(hidden=torch.randn(8)), "hidden"),
    (dict(weight=torch.randn(10, 5)), "weight"),              # D mismatch
    (dict(weight=torch.randn(10, 4, dtype=torch.float64)), "weight"),
    (dict(hidden=torch.zeros(2, 4, dtype=torch.long)), "hidden"),
])
def test_bad_inputs_raise_value_error_naming_the_argument(kwargs: dict, arg: str) -> None:
    args = dict(hidden=torch.randn(2, 4), weight=torch.randn(10, 4), targets=torch.tensor([0, 9]))
    temperature = kwargs.pop("temperature", 1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=arg):
        token_logprobs(args["hidden"], args["weight"], args["targets"], temperature=temperature)


def _run_self(*argv: str, env_extra: dict[str, str] | None = None, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _entropy_skip_case() -> dict:
    """The trainer's entropy term at coefficient 0 (`t1core.update.entropy_term`) against adding 0 * entropy loss
    (what it did before) and against a log-prob-only call: loss and gradients, and whether a gradient reached the
    entropy output (a hook on it counts)."""
    from t1core.losses import entropy_bonus
    from t1core.update import entropy_term
    hidden, weight, targets, g_logp, _ = _problem(13, 16, 700, seed=21, ignore_rows=(1, 7), scale=2.0)
    mask = targets != -100

    def run(mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if mode == "logp_only":
            logp, ent = token_logprobs(h, w, targets, temperature=0.9), None
        else:
            logp, ent = token_logprobs(h, w, targets, temperature=0.9, return_entropy=True)
        reached = []
        if ent is not None:
            ent.register_hook(lambda g: reached.append(g) if g is not None else None)  # None: no gradient
        loss = (logp * g_logp).sum()
        if mode == "times_zero":
            loss = loss + 0.0 * entropy_bonus(ent, mask)[0]
        elif mode in ("skip", "coef"):
            term, metrics = entropy_term(ent, mask, coef=0.0 if mode == "skip" else 0.01)
            assert "policy/entropy" in metrics
            loss = loss if term is None else loss + term
        loss.backward()
        return loss.detach(), h.grad, w.grad, len(reached)

    out = {m: run(m) for m in ("skip", "times_zero", "logp_only", "coef")}
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(out[a][:3], out[b][:3]))  # noqa: E731
    return dict(skip_eq_times_zero=same("skip", "times_zero"), skip_eq_logp_only=same("skip", "logp_only"),
                skip_reached=out["skip"][3], times_zero_reached=out["times_zero"][3], coef_reached=out["coef"][3],
                coef_changes_grad=not torch.equal(out["coef"][1], out["skip"][1]))


def _assert_entropy_skip(r: dict) -> None:
    assert r["skip_reached"] == 0 and r["times_zero_reached"] == 1 and r["coef_reached"] == 1, r
    assert r["skip_eq_times_zero"] and r["skip_eq_logp_only"] and r["coef_changes_grad"], r


def test_zero_entropy_coefficient_skips_the_entropy_gradient(cpu_path: str) -> None:
    _assert_entropy_skip(_entropy_skip_case())


@pytest.mark.interpreter
def test_zero_entropy_coefficient_skips_the_entropy_gradient_triton_interpreter() -> None:
    out = _run_self("--entropy-skip", env_extra={"TRITON_INTERPRET": "1", "T1_KERNEL_BACKEND": "triton"})
    _assert_entropy_skip(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.slow
def test_logprob_tiles_compile_for_sm90a_without_spills() -> None:
    """ptxas compiles the log-prob kernels at N = 64k (forward with and without entropy, backward with and without
    an entropy gradient) for sm_90a without register spills (`python -m t1kernels.aot_report`)."""
    rows, proc = aot_rows("logprob")
    variants = {(r["kernel"], r["constexprs"].get("WITH_ENTROPY", r["constexprs"].get("HAS_GEN"))) for r in rows}
    assert variants == {("_logprob_fwd_kernel", False), ("_logprob_fwd_kernel", True),
                        ("_logprob_bwd_dz_kernel", False), ("_logprob_bwd_dz_kernel", True)}, proc.stderr[-3000:]
    spilling = [r for r in rows if r["spills"]]
    assert not spilling and proc.returncode == 0, (spilling, proc.stderr[-2000:])


@pytest.mark.interpreter
def test_triton_interpreter_matches_float64_reference() -> None:
    out = _run_self("--interpreter", env_extra={"TRITON_INTERPRET": "1", "T1_KERNEL_BACKEND": "triton"})
    results = json.loads(out.strip().splitlines()[-1])
    assert len(results) >= 6
    for r in results:
        assert r["logp"] < VAL_TOL and r["entropy"] < VAL_TOL, r
        assert r["d_hidden"] < GRAD_TOL and r["d_weight"] < GRAD_TOL, r


@pytest.mark.slow
def test_cpu_memory_bound_at_issue_shape() -> None:
    N, D, V = 4096, 1024, 151_936
    r = json.loads(_run_self("--memory", str(N), str(D), str(V)).strip().splitlines()[-1])
    # The materialising reference holds at least one fp32 [N, V] logits tensor (in practice several: logits,
    # log-softmax, their gradients); the bound is taken against that single tensor, the smallest it can need.
    reference_floor = N * V * 4
    assert r["extra_bytes"] <= 0.10 * reference_floor, (r, reference_floor)


# ---- subprocess entry points -------------------------------------------------------------------------------

def _interpreter_cases() -> list[dict]:
    from t1kernels import logprob_triton
    results = []
    cases = [  # (N, D, V, temperature, vocab_per_split, scratch_bytes)
        (5, 24, 1000, 0.6, None, None), (5, 24, 1000, 1.0, None, None), (9, 17, 3001, 1.3, None, None),
        (20, 24, 3001, 1.0, 256, 20 * 4 * 300),  # several forward splits and backward chunks, ragged ends
    ]
    for N, D, V, temp, split, scratch in cases:
        hidden, weight, targets, g_logp, g_ent = _problem(N, D, V, seed=N * V, scale=2.0)
        lp, en, lse, mz = logprob_triton.triton_logprob_fwd(hidden, weight, targets, temperature=temp,
                                                            ignore_index=-100, with_entropy=True,
                                                            vocab_per_split=split)
        kw = {} if scratch is None else {"scratch_bytes": scratch}
        gh, gw = logprob_triton.triton_logprob_bwd(hidden, weight, targets, lse, mz, g_logp, g_ent,
                                                   temperature=temp, ignore_index=-100,
                                                   scratch_fill=float("nan"), **kw)
        rlp, ren, rgh, rgw = _grads(reference_token_logprobs, hidden, weight, targets, g_logp, g_ent, temp,
                                    dtype=torch.float64)
        results.append(dict(case=[N, D, V, temp, split, scratch],
                            logp=float(((lp.double() - rlp).abs() / (1 + rlp.abs())).max()),
                            entropy=float(((en.double() - ren).abs() / (1 + ren.abs())).max()),
                            d_hidden=_rel(gh, rgh), d_weight=_rel(gw, rgw)))
    # Through the public function and autograd (T1_KERNEL_BACKEND=triton): logp-only and entropy-only.
    hidden, weight, targets, g_logp, g_ent = _problem(6, 16, 1500, seed=11)
    for which in ("logp", "entropy"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
        lp, en = token_logprobs(h, w, targets, temperature=0.8, return_entropy=True)
        rlp, ren = reference_token_logprobs(hr, wr, targets, temperature=0.8)
        out, ref, g = (lp, rlp, g_logp) if which == "logp" else (en, ren, g_ent)
        (out * g).sum().backward()
        (ref * g.double()).sum().backward()
        results.append(dict(case=["public", which], logp=float((lp.double() - rlp).abs().max()),
                            entropy=float((en.double() - ren).abs().max()),
                            d_hidden=_rel(h.grad, hr.grad), d_weight=_rel(w.grad, wr.grad)))
    return results


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_probe(N: int, D: int, V: int, provider: str = "chunked") -> dict:
    """Peak RSS of one fwd+bwd in this process, minus the RSS before it and the two gradients.

    VmHWM is reset just before the measured call (writing 5 to /proc/self/clear_refs), so neither the inputs'
    construction nor a parent's peak (getrusage's ru_maxrss survives exec on Linux) can leak into the figure.
    provider: "chunked" (token_logprobs) or "materialising" (the fp32 reference); bench/ uses both.
    """
    import time

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    small = token_logprobs(hidden[:2], weight[:10], targets[:2] % 10)  # load BLAS and autograd code paths
    small.sum().backward()
    hidden.grad = weight.grad = None
    base = _proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    if provider == "chunked":
        logp, ent = token_logprobs(hidden, weight, targets, return_entropy=True)
    elif provider == "materialising":
        logp, ent = reference_token_logprobs(hidden, weight, targets, dtype=torch.float32)
    else:
        raise ValueError(f"provider: expected 'chunked' or 'materialising', got {provider!r}")
    (logp.sum() + ent.sum()).backward()
    seconds = time.perf_counter() - t0
    peak = _proc_status_bytes("VmHWM")
    # The gradients of hidden and weight are outputs any implementation must hold: not "extra".
    grads = hidden.grad.nbytes + weight.grad.nbytes
    return dict(base_bytes=base, peak_bytes=peak, grad_bytes=grads, extra_bytes=peak - base - grads,
                seconds=seconds)


if __name__ == "__main__":
    if sys.argv[1] == "--interpreter":
        print(json.dumps(_interpreter_cases()))
    elif sys.argv[1] == "--entropy-skip":
        print(json.dumps(_entropy_skip_case()))
    elif sys.argv[1] == "--memory":
        print(json.dumps(_memory_probe(*map(int, sys.argv[2:5]), *sys.argv[5:6])))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
