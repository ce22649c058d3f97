"""The random state of a run: the global RNGs (python, numpy, torch CPU, CUDA) and its named generators, captured
into a checkpoint and restored from one so that a resumed run draws exactly what a straight one does."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

AnyGenerator = torch.Generator | np.random.Generator | random.Random



def _generator_state(gen: AnyGenerator) -> dict[str, Any]:
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "state": gen.get_state()}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy", "state": gen.bit_generator.state}
    if isinstance(gen, random.Random):
        return {"kind": "python", "state": gen.getstate()}
    raise TypeError(f"generator: expected torch.Generator, numpy Generator or random.Random, got {type(gen)}")


def _set_generator_state(name: str, gen: AnyGenerator, saved: dict[str, Any]) -> None:
    kind = _generator_state(gen)["kind"]
    if kind != saved["kind"]:
        raise ValueError(f"generator {name!r}: expected a {saved['kind']} generator (as saved), got {kind}")
    if isinstance(gen, torch.Generator):
        gen.set_state(saved["state"])
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = saved["state"]
    else:
        gen.setstate(saved["state"])


def capture_rng_state(generators: Mapping[str, AnyGenerator] | None = None) -> dict[str, Any]:
    """The global RNG states (python, numpy legacy, torch CPU, CUDA if initialised) and those of the
    run's named generators. Contains only tensors and plain Python values (loadable with weights_only)."""
    algo, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (algo, keys.tolist(), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        # Only when CUDA is in use: asking for CUDA states would otherwise initialise it.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "generators": {name: _generator_state(g) for name, g in (generators or {}).items()},
    }


def restore_rng_state(state: Mapping[str, Any], generators: Mapping[str, AnyGenerator] | None = None) -> None:
    """Undo draws since `capture_rng_state`: the global RNGs, and `generators` in place. The names given must
    be exactly those captured; without `generators`, only the global RNGs are restored."""
    random.setstate(state["python"])
    algo, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((algo, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        if not torch.cuda.is_available():
            raise ValueError(f"rng state: holds {len(state['cuda'])} CUDA generator states, but CUDA is not "
                             "available here (load with restore_rng=False to inspect the checkpoint)")
        torch.cuda.set_rng_state_all(state["cuda"])
    if generators is not None:
        saved = state["generators"]
        if set(generators) != set(saved):
            raise ValueError(f"generators: expected the captured names {sorted(saved)}, got {sorted(generators)}")
        for name, gen in generators.items():
            _set_generator_state(name, gen, saved[name])
