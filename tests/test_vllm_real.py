"""The vLLM adapter against the real vLLM 0.33.0 classes that import on a CPU (the `vllm_real` lane).

The wheel is fetched once and cached outside the repository (tests/vllm_wheel.py); the lane skips, saying why, when
no package registry answers. What runs here is vLLM's own code: `SamplingParams` validation on every request the
adapter builds; the msgpack encoder/decoder that AsyncLLM's `collective_rpc` puts every weight-sync payload through
(v1/serial_utils.py); the worker engines' update-info classes that parse those payloads (ipc_engine.py,
nccl_engine.py); the trainer-side transfer pieces (`packed_ipc_producer`, `NCCLTrainerWeightTransferEngine`) over
three consecutive updates; the log-prob container and `CompletionOutput` the converters read. Only the data plane is
stubbed (CUDA memory, IPC export, the NCCL rendezvous and broadcast), and the model behind the engine is the fake's
(tests/fake_vllm.py: vLLM's worker needs CUDA, `vllm.v1.worker.gpu_worker` does not import on a CPU). Each test
here fails on the adapter before issue #42's fixes: raw IPC handles (msgpack TypeError), the NCCL engine's first
client labelling every update "1", temperatures in (0, 0.01) accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib
import queue
import socket
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from rollout import vllm_api, vllm_weights
from rollout.engine import SamplingParams
from rollout.vllm_convert import flush_sampling_kwargs, moe_routing, sampled_logprobs, vllm_sampling_kwargs
from rollout.vllm_engine import VLLMEngine
from t1model.hf_io import hf_state_dict
from t1model.model import ModelConfig, MoEModel
from tests import fake_vllm, vllm_wheel

pytestmark = pytest.mark.vllm_real

CFG = ModelConfig.tiny().replace(num_hidden_layers=2)
MAX_LEN = 64


@pytest.fixture(scope="module")
def vllm_src() -> Iterator[types.ModuleType]:
    try:
        src = vllm_wheel.source_dir()
    except vllm_wheel.Unavailable as e:
        pytest.skip(str(e))
    sys.path.insert(0, str(src))
    try:
        yield importlib.import_module("vllm")
    finally:  # later tests see no vLLM, as before this module
        sys.path.remove(str(src))
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]


def _rpc(payload: Any) -> Any:
    """`payload` after vLLM's msgpack round trip (what `collective_rpc` does to a kwarg), insecure pickling off."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder().decode(MsgpackEncoder().encode(payload))


# ---- requests ----
def test_vllm_keeps_every_request_the_adapter_builds(vllm_src: types.ModuleType) -> None:
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VllmParams

    for temp in (0.0, 0.01, 0.3, 1.0, 1.7):
        for stops, start in (((), 0), ((3, 5), 4)):
            p = SamplingParams(temperature=temp, max_new_tokens=9, stop_token_ids=stops, seed=11,
                               prompt_routing_from=start)
            kw = vllm_sampling_kwargs(p, max_tokens=7)
            sp = VllmParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY)
            assert {k: getattr(sp, k) for k in kw} == kw, f"vLLM changed a field of {kw}"
    kw = flush_sampling_kwargs(routed_from=12)
    sp = VllmParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY)
    assert {k: getattr(sp, k) for k in kw} == kw
    # vLLM raises (0, 0.01) to 0.01 (sampling_params.py:560); the adapter refuses it, the fake clamps as vLLM does
    assert VllmParams(temperature=0.005).temperature == 0.01 == fake_vllm.SamplingParams(temperature=0.005).temperature
    with pytest.raises(ValueError, match=r"\(0, 0.01\)"):
        vllm_sampling_kwargs(SamplingParams(temperature=0.005), max_tokens=4)


def test_converters_read_vllms_outputs(vllm_src: types.ModuleType) -> None:
    from vllm.logprobs import Logprob, create_sample_logprobs
    from vllm.outputs import CompletionOutput

    tokens, lps = [7, 3, 9], [-0.5, -1.25, -0.0625]
    for flat in (False, True):
        logprobs = create_sample_logprobs(flat)
        for t, lp in zip(tokens, lps):
            logprobs.append({t: Logprob(logprob=lp, rank=1)})
        rows = np.array([[[1, 2]], [[3, 0]]], dtype=np.uint8)  # [rows, L=1, K=2]
        out = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs,
                               routed_experts=rows, finish_reason="stop")
        assert sampled_logprobs(out.logprobs, out.token_ids).tolist() == lps
        routing = moe_routing(out.routed_experts, moe_layer_ids=[0], num_hidden_layers=1, top_k=2, num_experts=4,
                              dtype=torch.uint8)
        assert routing.tolist() == [[[1, 2]], [[3, 0]]]


# ---- weight sync: IPC (colocated) ----
class _StubIpc:
    """The CUDA side of vLLM's packed IPC producer: the buffer lives in CPU memory and `reduce_tensor` returns the
    argument tuple torch's CUDA branch returns (torch/multiprocessing/reductions.py: tensor class, size, stride,
    offset, storage class, dtype, device, handle bytes, storage size/offset, requires_grad, ref counter, event)."""

    def __init__(self) -> None:
        self.buffers: dict[bytes, torch.Tensor] = {}

    def reduce_tensor(self, t: torch.Tensor) -> tuple[Any, tuple]:
        handle = f"handle-{len(self.buffers)}".encode()
        self.buffers[handle] = t
        args = (type(t), t.size(), t.stride(), 0, torch.UntypedStorage, t.dtype, 0, handle, t.numel(), 0, False,
                b"ref", 0, b"event", True)
        return None, args

    def torch_on_cpu(self) -> types.SimpleNamespace:
        stream = types.SimpleNamespace(synchronize=lambda: None)
        return types.SimpleNamespace(empty=lambda *a, device=None, **k: torch.empty(*a, **k), uint8=torch.uint8,
                                     accelerator=types.SimpleNamespace(current_stream=lambda: stream))


class _RealWireLLM(fake_vllm.FakeAsyncLLM):
    """The fake AsyncLLM behind vLLM's wire: every weight-sync payload goes through vLLM's msgpack (as
    `collective_rpc` sends it) and is parsed by the worker engine's own info classes; tensors come off the stubbed
    data plane (`ipc` buffers or the `nccl` queue)."""

    ipc: _StubIpc
    nccl: queue.Queue
    versions: list[str]

    async def init_weight_transfer_engine(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo

        info = _rpc(request.init_info)
        self.backend = self.args["weight_transfer_config"]["backend"]
        cls = IPCWeightTransferInitInfo if self.backend == "ipc" else NCCLWeightTransferInitInfo
        self.transfer_init, self._meta = info, None
        assert cls(**info).packed

    async def update_weights(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        info = _rpc(request.update_info)
        self.calls.append(("update_weights", info["names"]))
        assert self.updating, "update_weights outside start/finish"
        if self.backend == "ipc":
            typed = IPCWeightTransferUpdateInfo(**info)  # unpickles the handles (ipc_engine.py:83-91)
            buffer = self.ipc.buffers[typed.ipc_handles["GPU-stub"][7]]
            dtypes = [getattr(torch, d) for d in typed.dtype_names]
            named = unpack_tensor(buffer[:sum(typed.tensor_sizes)], typed.names, typed.shapes, dtypes,
                                  typed.tensor_sizes)
        else:
            typed = NCCLWeightTransferUpdateInfo(**info)
            if typed.names:  # empty: the metadata of the previous update (nccl_engine.py, NCCLWeightTransferUpdateInfo)
                self._meta = typed
            named = [(n, self.nccl.get(timeout=30)) for n in self._meta.names]
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named:
                self._load(params, name, t, self.cfg.moe_intermediate_size)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.versions.append(weight_version)
        await super().finish_weight_update(weight_version)


def _engine(model: MoEModel, llm_cls: type, placement: str, *, port: int = 1) -> VLLMEngine:
    api = fake_vllm.fake_api()
    api = vllm_api.VllmApi(**{**api.__dict__, "make_llm": llm_cls, "make_transport": vllm_weights.VllmTransport})
    nccl = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2} if placement != "colocated" else None
    args = vllm_api.engine_args(model_dir=_save(model), dtype=torch.float32, seed=0, tensor_parallel_size=1,
                                gpu_memory_utilization=0.5, max_model_len=MAX_LEN, enforce_eager=True,
                                colocated=placement == "colocated")
    return VLLMEngine(model.config, api=api, engine_args=args, placement=placement, nccl_init=nccl,
                      weight_dtype=torch.float32, owned_dir=args["model"], wire_device="cpu")


def _save(model: MoEModel) -> str:
    import tempfile

    from t1model.hf_io import save_pretrained

    path = tempfile.mkdtemp(prefix="t1-vllm-real-")
    save_pretrained(model, path)
    return path


def _three_updates(engine: VLLMEngine, llm_cls: type) -> None:
    """Versions 1, 2, 3 reach vLLM, each update's weights arrive whole, and requests are served after each."""
    p = SamplingParams(max_new_tokens=4, temperature=0.0, seed=1)
    for version, seed in ((1, 5), (2, 6), (3, 7)):
        new = MoEModel(CFG, seed=seed)
        assert engine.update_weights(hf_state_dict(new).items()) == version
        assert engine.submit([5, 6, 7], p).result().policy_version == version
        served, want = engine._llm.model.state_dict(), new.state_dict()
        assert served.keys() == want.keys() and all(torch.equal(served[k], want[k]) for k in want)
    assert llm_cls.versions == ["1", "2", "3"]


def test_ipc_updates_pass_vllms_msgpack_and_worker_parsing(vllm_src: types.ModuleType,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.weight_transfer import packed_tensor

    stub = _StubIpc()
    monkeypatch.setattr(packed_tensor, "reduce_tensor", stub.reduce_tensor)
    monkeypatch.setattr(packed_tensor, "torch", stub.torch_on_cpu())
    monkeypatch.setattr(vllm_weights, "gpu_uuid", lambda: "GPU-stub")
    monkeypatch.setattr(vllm_weights, "PACKED_BUFFER_BYTES", 1 << 18)  # several chunks per update
    for key, value in vllm_api.engine_environment().items():  # what load_vllm leaves for vLLM's processes
        monkeypatch.setenv(key, value)
    llm_cls = type("IpcLLM", (_RealWireLLM,), {"ipc": stub, "versions": []})
    with _engine(MoEModel(CFG, seed=0), llm_cls, "colocated") as engine:
        _three_updates(engine, llm_cls)
    # What the adapter sent before #42, into an engine started without VLLM_ALLOW_INSECURE_SERIALIZATION: the raw
    # handle, which vLLM's encoder refuses (serial_utils.py:220)
    _, raw = stub.reduce_tensor(torch.empty(4, dtype=torch.uint8))
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    with pytest.raises(TypeError, match="not serializable"):
        _rpc({"names": ["w"], "ipc_handles": {"GPU-stub": raw}})


# ---- weight sync: NCCL (disaggregated) ----
def test_the_033_weight_source_is_fed_through_iter_full(vllm_src: types.ModuleType) -> None:
    """0.33's trainer-side WeightSource: `iter_full` and a cached-property `metadata` (0.32's `__iter__` and method,
    checked in the vllm_cpu lane, are refused by it)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    line = vllm_api.GPU_LINE
    assert hasattr(WeightSource, "iter_full") and line.source_api == ("iter_full", "property")
    model = MoEModel(CFG, seed=2)
    source = vllm_weights._make_source(vllm_weights.expected_hf_params(CFG), torch.float32, line.source_api)
    source.stream = iter(hf_state_dict(model).items())
    assert source.implements_iter_full() and [m.name for m in source.metadata] == list(hf_state_dict(model))
    assert [n for n, _ in source.iter_full()] == list(hf_state_dict(model))
    with pytest.raises(TypeError, match="metadata must be a functools.cached_property"):
        vllm_weights._make_source([], torch.float32, vllm_api.CPU_LINE.source_api)


def test_nccl_engine_labels_three_updates_1_2_3(vllm_src: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own trainer-side NCCL engine keeps the client of its first send: the version must come from it."""
    from vllm.distributed.weight_transfer import nccl_engine

    wire: queue.Queue = queue.Queue()

    def broadcast(*, iterator: Any, post_iter_func: Any, **_: Any) -> None:
        for item in iterator:
            wire.put(post_iter_func(item).clone())

    def rendezvous(*, init_worker: Any, init_trainer: Any) -> None:
        init_worker()
        init_trainer()

    group = types.SimpleNamespace(destroy=lambda: None)
    monkeypatch.setattr(nccl_engine, "run_trainer_rendezvous", rendezvous)
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: group)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", broadcast)
    llm_cls = type("NcclLLM", (_RealWireLLM,), {"nccl": wire, "versions": []})
    with _engine(MoEModel(CFG, seed=0), llm_cls, "disaggregated") as engine:
        _three_updates(engine, llm_cls)
        assert isinstance(engine._transport._engine, nccl_engine.NCCLTrainerWeightTransferEngine)


# ---- weight sync: NCCL's data plane as gloo, an update broken half-way, recovery ----
class _GlooGroup:
    """What vLLM's PyNcclCommunicator is to its weight transfer (`broadcast(tensor, src, stream)`, `destroy()`), on
    the CPU: vLLM's own StatelessProcessGroup rendezvous (a TCPStore on master_port), then a gloo group on its store.
    `destroy` aborts the group, so a peer blocked in a broadcast fails at once, as NCCL's teardown makes it."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, device: Any = None) -> None:
        import torch.distributed as dist
        from vllm.distributed.utils import StatelessProcessGroup

        self.meta = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank,
                                                 world_size=world_size)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.meta.store), rank, world_size,
                                        datetime.timedelta(seconds=60))

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self.pg.abort()


class _NoStream:
    """A CUDA stream's calls the packed producer and consumer make, for CPU tensors (nothing is asynchronous)."""

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:  # also stands in for torch.Event
        pass


class _GlooWireLLM(_RealWireLLM):
    """The fake AsyncLLM's worker on vLLM's NCCL wire with gloo under it: it joins the trainer's rendezvous at
    init_weight_transfer_engine and receives each update with vLLM's own `packed_nccl_broadcast_consumer`, on a
    thread of its own (the worker process), into the fake's model."""

    versions: list[str]
    received: list[str]

    async def init_weight_transfer_engine(self, request: Any) -> None:
        from vllm.distributed.weight_transfer import nccl_common
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo

        info = NCCLWeightTransferInitInfo(**_rpc(request.init_info))
        self.transfer_init, self._meta, self.wire_info = dict(_rpc(request.init_info)), None, info
        self.group = await asyncio.to_thread(nccl_common.stateless_init_process_group, info.master_address,
                                             info.master_port, info.rank_offset, info.world_size, 0)

    async def update_weights(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        typed = NCCLWeightTransferUpdateInfo(**_rpc(request.update_info))
        self.calls.append(("update_weights", typed.names))
        assert self.updating, "update_weights outside start/finish"
        if typed.names:
            self._meta = typed
        try:
            await asyncio.to_thread(self._receive, self._meta)
        except BaseException:
            self.updating = False  # what vLLM's worker does (gpu_worker.py:1622-1626)
            raise

    def _receive(self, meta: Any) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        params, f = dict(self.model.named_parameters()), self.cfg.moe_intermediate_size

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            with torch.no_grad():
                for name, t in named:
                    self._load(params, name, t, f)
                    self.received.append(name)

        packed_nccl_broadcast_consumer(
            iterator=((n, (s, getattr(torch, d))) for n, d, s in zip(meta.names, meta.dtype_names, meta.shapes)),
            group=self.group, src=0, post_unpack_func=load, buffer_size_bytes=self.wire_info.packed_buffer_size_bytes,
            num_buffers=self.wire_info.packed_num_buffers, device="cpu")

    def shutdown(self, timeout: float | None = None) -> None:
        super().shutdown(timeout)
        if getattr(self, "group", None) is not None:
            self.group.destroy()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _break_after(items: list[tuple[str, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(items):
        if i == n:
            raise RuntimeError("the trainer lost a rank half-way through the update")
        yield item


def test_nccl_update_broken_half_way_recovers_over_gloo(vllm_src: types.ModuleType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 58: vLLM's trainer-side NCCL engine and its packed producer/consumer over a real gloo group (the CPU
    stubs: gloo for NCCL, no-op CUDA streams and events). An update whose weight stream fails half-way leaves the
    worker blocked in a broadcast; requests are refused; the next update restarts the engine, which tears the group
    down through VllmTransport.reset() (the worker's broadcast fails at once) and rendezvouses again on the same port;
    then three updates reach vLLM as versions 1, 2, 3, each served whole."""
    from vllm.distributed.weight_transfer import nccl_common, nccl_engine, packed_tensor

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", _GlooGroup)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a: _NoStream())
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda device, n: tuple(_NoStream() for _ in range(n)))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch, "Event", _NoStream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(vllm_weights, "PACKED_BUFFER_BYTES", 1 << 16)  # many chunks per update
    llm_cls = type("GlooLLM", (_GlooWireLLM,), {"versions": [], "received": []})
    with _engine(MoEModel(CFG, seed=0), llm_cls, "disaggregated", port=_free_port()) as engine:
        items = list(hf_state_dict(MoEModel(CFG, seed=4)).items())
        with pytest.raises(RuntimeError, match="lost a rank"):
            engine.update_weights(_break_after(items, len(items) // 2))
        assert 0 < len(llm_cls.received) < len(items)  # chunks before the break reached the worker
        first = engine._transport._engine
        assert isinstance(first, nccl_engine.NCCLTrainerWeightTransferEngine)
        with pytest.raises(RuntimeError, match="failed after"):
            engine.submit([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0.0)).result(timeout=60)
        _three_updates(engine, llm_cls)  # versions 1, 2, 3 in order, each update's weights whole
        assert engine.stats["restarts"] == 1 and engine._transport._engine is not first
        assert first.model_update_group is None  # reset() shut the broken group down
