"""The installed project owns its import names, and lives beside transformers (whose newest releases import
Hugging Face's `kernels` distribution) in one process, from the checkout and from anywhere else.

Why: our kernels package was once called `kernels`. In the repo root it shadowed Hugging Face's, so
`from transformers import Qwen3MoeForCausalLM` failed; elsewhere theirs shadowed ours."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"t1config", "t1kernels", "t1model", "t1core", "rollout", "sandbox", "t1cli"}
"""The top-level import names the `t1` distribution installs (setup.py)."""
TAKEN = {"kernels", "tests", "test", "bench", "benchmarks", "examples", "scripts", "tools", "utils", "common",
         "model", "models", "src", "docs"}
"""Top-level names that distributions installed beside torch, transformers or vLLM provide (Hugging Face's
`kernels`) or that sloppy wheels ship at the top level (`tests`, `utils`, ...): never one of ours."""


def _t1() -> metadata.Distribution:
    try:
        return metadata.distribution("t1")
    except metadata.PackageNotFoundError:
        pytest.fail("the t1 distribution is not installed: run scripts/setup.sh (pip install -e '.[dev]')")


def test_the_distribution_installs_exactly_our_packages() -> None:
    """tests/ and bench/ run from the checkout: installed, they would be top-level `tests` and `bench`."""
    top_level = set(_t1().read_text("top_level.txt").split())
    assert top_level == OURS
    assert not OURS & TAKEN


def test_no_other_installed_distribution_provides_our_names() -> None:
    providers = metadata.packages_distributions()
    clashes = {name: sorted(set(providers[name]) - {"t1"}) for name in OURS if set(providers.get(name, ())) - {"t1"}}
    assert not clashes, f"other distributions provide our import names: {clashes}"


_SNIPPET = """
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
import t1kernels, t1kernels.moe, t1kernels.logprob, t1model.model
try:
    import kernels  # Hugging Face's, when transformers brought it: it must be theirs, not ours
    assert not kernels.__file__.startswith({root!r}), kernels.__file__
except ImportError:
    pass
cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     num_experts=4, num_experts_per_tok=2)
torch.manual_seed(0)
hf = Qwen3MoeForCausalLM(cfg).eval()
ids = torch.tensor([[1, 2, 3]])
x_TD = torch.randn(3, 32)
logits_TE = torch.randn(3, 4)
w_TK, ids_TK = t1kernels.moe.route(logits_TE, 2)
assert torch.isfinite(hf(ids).logits).all() and ids_TK.shape == (3, 2)
print("ok")
"""


@pytest.mark.parametrize("where", ["repo_root", "elsewhere"])
def test_transformers_qwen3_moe_and_our_kernels_in_one_process(where: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cwd = ROOT if where == "repo_root" else tmp_path
    proc = subprocess.run([sys.executable, "-c", _SNIPPET.format(root=str(ROOT))], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _lock(name: str) -> dict[str, str]:
    """locks/NAME.txt as {normalized distribution name: version}."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "locks" / f"{name}.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            dist, _, version = line.partition("==")
            assert version, f"locks/{name}.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(dist)] = version
    return pins


def _setup_requirements(*extras: str) -> list[str]:
    import ast

    kw = {k.arg: k.value for n in ast.walk(ast.parse((ROOT / "setup.py").read_text())) if isinstance(n, ast.Call)
          for k in n.keywords}
    reqs = ast.literal_eval(kw["install_requires"])
    return reqs + [r for e in extras for r in ast.literal_eval(kw["extras_require"])[e]]


@pytest.mark.parametrize("lock, extras", [("cpu", ("dev",)), ("gpu", ("gpu", "dev", "flash"))])
def test_each_lock_pins_every_requirement_at_a_version_setup_py_accepts(lock: str, extras: tuple[str, ...]) -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = _lock(lock)
    for text in _setup_requirements(*extras):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"locks/{lock}.txt does not pin {req.name}"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), f"locks/{lock}.txt: {name}=={pins[name]} " \
            f"is outside setup.py's {req}"
    if lock == "cpu":
        assert pins["torch"].endswith("+cpu")  # the CPU wheel: a bare torch would be a multi-GB CUDA build
    else:  # what vLLM 0.33.0 itself requires (its wheel's metadata)
        assert pins["vllm"] == "0.33.0" and pins["torch"] == "2.14.0"
        assert Version(pins["transformers"]) < Version("5.21")


def test_the_installed_set_is_the_lock() -> None:
    """What setup.sh installed is what CI tested: every locked distribution present here has the locked version."""
    import torch
    from packaging.utils import canonicalize_name

    pins = _lock("gpu" if torch.version.cuda else "cpu")
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    drift = {name: (installed[name], version) for name, version in pins.items()
             if name in installed and installed[name] != version}
    assert not drift, f"installed vs locked: {drift} (run scripts/setup.sh, or refresh the lock: scripts/lock.sh)"
    missing = sorted(set(pins) - set(installed))
    assert not missing or torch.version.cuda, f"locked but not installed: {missing}"
