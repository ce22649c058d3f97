"""Streaming the trainer's weights into vLLM: the expected HF tensors, a validating stream, vLLM's transports.

The engine's weight update takes `(name, tensor)` chunks under the HF Qwen3-MoE names of
`t1core.hf_io.hf_state_dict` (per-expert `mlp.experts.{e}.gate_proj.weight` etc., whole unsharded tensors),
consumed one at a time. vLLM's wire formats (packed NCCL broadcast, packed CUDA IPC) declare every parameter's
name, dtype and shape before the bytes, so the chunks must come in the canonical order (`expected_hf_params`,
which is `hf_state_dict`'s order) and each exactly once: `ValidatedStream` checks that as it goes and, at the
end, that nothing is missing. The transport itself is vLLM's own trainer-side engine
(`WeightTransferTrainerFactory.trainer_init`), fed by a `WeightSource` over the stream and driving the
inference side through a `VLLMWeightSyncClient` that the engine implements on its event loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, Protocol

import torch

from t1core.model import ModelConfig, MoEModel

Backend = Literal["ipc", "nccl"]


def expected_hf_params(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor a complete update carries, in `t1core.hf_io.hf_state_dict` order."""
    state = MoEModel(cfg, seed=None, device="meta").state_dict()  # names and shapes only, no memory
    out: list[tuple[str, tuple[int, ...]]] = []
    f = cfg.moe_intermediate_size
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.w13"):
            prefix = name.rsplit(".", 1)[0]
            for e in range(cfg.num_experts):
                out.append((f"{prefix}.{e}.gate_proj.weight", (f, t.shape[2])))
                out.append((f"{prefix}.{e}.up_proj.weight", (t.shape[1] - f, t.shape[2])))
        elif name.endswith("mlp.experts.w2"):
            prefix = name.rsplit(".", 1)[0]
            out.extend((f"{prefix}.{e}.down_proj.weight", tuple(t.shape[1:])) for e in range(cfg.num_experts))
        else:
            out.append((name, tuple(t.shape)))
    return out


class ValidatedStream:
    """Iterate `chunks` once, checking each against `expected` (name in order, shape, a floating tensor) and
    converting it to the wire `dtype`/`device`; after the last chunk, ValueError if any expected name is
    missing. `count` is how many chunks have passed."""

    def __init__(self, chunks: Iterable[tuple[str, torch.Tensor]], expected: list[tuple[str, tuple[int, ...]]], *,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self._chunks, self._expected = chunks, expected
        self._dtype, self._device = dtype, torch.device(device)
        self.count = 0
        self._started = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a weight stream is consumed once")
        self._started = True
        seen: set[str] = set()
        for item in self._chunks:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"named_tensors: expected (str, torch.Tensor) pairs, got {type(item).__name__} "
                                f"{item!r:.80}")
            name, tensor = item
            if self.count >= len(self._expected):
                raise ValueError(f"named_tensors: unexpected extra tensor {name!r} after all "
                                 f"{len(self._expected)} expected ones")
            want, shape = self._expected[self.count]
            if name != want:
                why = "arrived twice" if name in seen else "is out of order or unknown"
                raise ValueError(f"named_tensors: expected {want!r} (tensor {self.count} of {len(self._expected)}, "
                                 f"hf_state_dict order), got {name!r}, which {why}")
            if tuple(tensor.shape) != shape or not tensor.is_floating_point():
                raise ValueError(f"named_tensors: {name} must be a floating tensor of shape {shape}, got "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")
            seen.add(name)
            self.count += 1
            yield name, tensor.detach().to(device=self._device, dtype=self._dtype).contiguous()
        if self.count != len(self._expected):
            missing = [n for n, _ in self._expected[self.count:]]
            raise ValueError(f"named_tensors: {len(missing)} of {len(self._expected)} tensors never arrived, "
                             f"first {missing[:3]}")


class WeightSyncClient(Protocol):
    """vLLM's `VLLMWeightSyncClient`: the inference side's weight-sync control plane (plain dicts)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self) -> None: ...


class Transport(Protocol):
    """Moves one validated stream into the inference engine through `client` (start, updates, finish)."""

    def send(self, stream: ValidatedStream, client: WeightSyncClient) -> None: ...


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class VllmTransport:
    """vLLM's own trainer-side engine (packed CUDA IPC when colocated, packed NCCL broadcast when disaggregated),
    initialised on the first update and fed each round through a `WeightSource` over that round's stream."""

    def __init__(self, *, backend: Backend, expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 nccl_init: dict[str, Any] | None = None) -> None:
        if backend not in ("ipc", "nccl"):
            raise ValueError(f"backend: expected 'ipc' or 'nccl', got {backend!r}")
        if backend == "nccl" and not nccl_init:
            raise ValueError("backend 'nccl' needs nccl_init={'master_address', 'master_port', 'world_size'}")
        self._backend, self._nccl_init = backend, nccl_init or {}
        self._source = _make_source(expected, dtype)
        self._engine: Any = None

    def send(self, stream: ValidatedStream, client: WeightSyncClient) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self._source.stream = stream
        try:
            if self._engine is None:
                self._engine = WeightTransferTrainerFactory.trainer_init(self._init_info(), client=client,
                                                                         source=self._source)
            self._engine.send_weights()
        finally:
            self._source.stream = None

    def _init_info(self) -> Any:
        # rank 0: this process is the only trainer rank that talks to the engine (it holds the whole tensors).
        if self._backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
            return IPCTrainerInitInfo(rank=0, packed=True)
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        return NCCLTrainerInitInfo(rank=0, packed=True, **self._nccl_init)


def _make_source(expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> Any:
    """A `vllm...base.WeightSource` whose metadata is `expected` and whose `iter_full` is the current stream
    (the class is built here because its base class lives in vLLM, imported only on a GPU machine)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _StreamSource(WeightSource):
        stream: ValidatedStream | None = None

        @functools.cached_property
        def metadata(self) -> list[Any]:
            return [ParamMeta(name, dtype, shape) for name, shape in expected]

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            if self.stream is None:
                raise RuntimeError("no weight stream is being sent")
            return iter(self.stream)

    return _StreamSource()


def wire_fields(names: list[str], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The `names` / `dtype_names` / `shapes` fields every vLLM update_info carries for a list of tensors."""
    return {"names": list(names), "dtype_names": [_torch_dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors]}


TransportFactory = Callable[[list[tuple[str, tuple[int, ...]]]], Transport]
