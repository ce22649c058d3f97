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
OURS = {"t1kernels", "t1model", "t1core", "rollout", "sandbox"}
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
