"""The slice of vLLM that `rollout.vllm_engine` uses, loaded and checked in one place.

`load_vllm()` imports vLLM, checks that it is a version this adapter was written against (0.33.x: routed-experts
capture with `routed_experts_prompt_start`, the weight-transfer API with trainer-side engines, sleep mode) and
returns a `VllmApi`: the request types, a constructor of `AsyncLLM` from engine arguments, and the weight
transport. It is the one seam a test replaces (tests/fake_vllm.py) to drive the adapter without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rollout.vllm_weights import Transport, VllmTransport

SUPPORTED = ((0, 33), (0, 34))
"""[lowest, first unsupported) (major, minor) of vLLM; keep in step with setup.py's `gpu` extra."""


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


def parse_version(text: str) -> tuple[int, int]:
    """'0.33.0' / '0.33.1rc2' / '0.34.0.dev3+g12ab' -> (0, 33)."""
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        raise ValueError(f"cannot read vLLM's version from {text!r}") from None


def check_version(text: str) -> None:
    """RuntimeError unless vLLM `text` is within `SUPPORTED`."""
    low, high = SUPPORTED
    if not low <= parse_version(text) < high:
        raise RuntimeError(f"rollout.engine='vllm' needs vLLM >= {low[0]}.{low[1]} and < {high[0]}.{high[1]} "
                           f"(routed-experts capture with routed_experts_prompt_start, the weight-transfer API), "
                           f"found {text}: pip install -e '.[gpu]'")


def require_vllm() -> None:
    """ValueError (one line: bad input of `python -m t1core.train`) unless a supported vLLM is installed; checked
    from the distribution's metadata, without importing vLLM (slow, and it initialises CUDA)."""
    from importlib import metadata, util

    if util.find_spec("vllm") is None:
        raise ValueError("rollout.engine='vllm' but vLLM is not installed here (it needs a CUDA machine): "
                         "pip install -e '.[gpu]', or rollout.engine='torch'")
    try:
        check_version(metadata.version("vllm"))
    except (RuntimeError, metadata.PackageNotFoundError) as e:
        raise ValueError(str(e) or "vLLM's version is unknown (no distribution metadata)") from None


def load_vllm() -> VllmApi:
    """Import vLLM and check it; RuntimeError naming what is missing (not installed, too old, no R3 support)."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError("rollout.engine='vllm' but vLLM is not importable here (it needs a CUDA machine): "
                           f"pip install -e '.[gpu]' ({e})") from e
    check_version(vllm.__version__)
    from vllm import SamplingParams, TokensPrompt
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    missing = [f for f, cls in (("enable_return_routed_experts", AsyncEngineArgs),
                                ("routed_experts_prompt_start", SamplingParams)) if f not in _field_names(cls)]
    if missing:
        raise RuntimeError(f"vLLM {vllm.__version__} lacks routed-experts capture ({missing}): pip install -e '.[gpu]'")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1") in ("0", "false", "False"):
        raise RuntimeError("VLLM_USE_V2_MODEL_RUNNER is off, but vLLM returns routed experts only from the V2 runner")
    os.environ.update(engine_environment())  # read by the engine processes vLLM is about to start

    def make_llm(kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        kwargs["weight_transfer_config"] = WeightTransferConfig(**kwargs["weight_transfer_config"])
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    return VllmApi(version=vllm.__version__, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt,
                   final_only=RequestOutputKind.FINAL_ONLY, WeightTransferInitRequest=WeightTransferInitRequest,
                   WeightTransferUpdateRequest=WeightTransferUpdateRequest, make_llm=make_llm,
                   make_transport=VllmTransport, wire_device="cuda")


def engine_environment() -> dict[str, str]:
    """What `load_vllm` puts in the environment before vLLM starts its engine processes (they inherit it):
    VLLM_USE_V2_MODEL_RUNNER (routed experts come only from the V2 runner) and VLLM_ALLOW_INSECURE_SERIALIZATION,
    without which the worker refuses the pickled CUDA IPC handles of a colocated weight update (ipc_engine.py:83-91;
    `rollout.vllm_weights.ipc_update_info` says why they travel pickled)."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _field_names(cls: Any) -> set[str]:
    fields = getattr(cls, "__struct_fields__", None) or getattr(cls, "__dataclass_fields__", None) or {}
    return set(fields)


def engine_args(*, model_dir: str, dtype: torch.dtype, seed: int, tensor_parallel_size: int,
                gpu_memory_utilization: float, max_model_len: int, enforce_eager: bool, colocated: bool,
                executor: str = "mp") -> dict[str, Any]:
    """`AsyncEngineArgs` for T1's rollouts: token ids in and out (no tokenizer), R3 capture (needs prefix caching
    on), post-temperature log-probs, sleep mode when the engine shares GPUs with the trainer, and the weight
    transfer backend of the placement (CUDA IPC on shared GPUs, NCCL to separate ones); `executor` 'mp' (vLLM's
    local executor: workers on this node) or 'ray' (vLLM's Ray executor places them on a running Ray cluster)."""
    if executor not in ("mp", "ray"):
        raise ValueError(f"executor: expected 'mp' or 'ray', got {executor!r}")
    # 'mp' leaves the choice to vLLM (one worker in its engine process at tensor_parallel_size 1, else processes)
    return {"model": model_dir, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
            "skip_tokenizer_init": True, "enable_prefix_caching": True, "enable_return_routed_experts": True,
            "logprobs_mode": "processed_logprobs", "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
            "enforce_eager": enforce_eager, "enable_sleep_mode": colocated, "disable_log_stats": True,
            "weight_transfer_config": {"backend": "ipc" if colocated else "nccl"},
            "distributed_executor_backend": "ray" if executor == "ray" else None}


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
