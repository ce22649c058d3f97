"""Hugging Face Qwen3-MoE checkpoints: config.json + safetensors (single file or sharded with an index).

Our module names equal HF's except the experts, which we keep stacked:
  model.layers.N.mlp.experts.w13 [E, 2F, D]  <->  model.layers.N.mlp.experts.M.{gate_proj,up_proj}.weight [F, D]
  model.layers.N.mlp.experts.w2  [E, D, F]   <->  model.layers.N.mlp.experts.M.down_proj.weight [D, F]
Loading also accepts the fused on-disk names `mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj`
[E, D, F]. Saving writes the per-expert names: what real Qwen3-MoE checkpoints use and what transformers 5.x
itself writes, so both transformers 4.x and 5.x load our output.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from t1model.dtypes import DTYPES
from t1model.model import ModelConfig, MoEModel, YarnScaling

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"



def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Qwen3-MoE config.json dict; ValueError for features this model does not implement."""
    if hf.get("model_type") != "qwen3_moe":
        raise ValueError(f"config.json: expected model_type 'qwen3_moe', got {hf.get('model_type')!r}")
    rope = hf.get("rope_parameters") or {}
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(hf.get("attention_bias", False)),
        "use_sliding_window": bool(hf.get("use_sliding_window", False)),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"config.json: unsupported Qwen3-MoE options {bad} (expected silu, no attention bias, "
                         f"no sliding window)")
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=num_heads, num_key_value_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        num_experts=hf.get("num_experts", hf.get("num_local_experts")),
        num_experts_per_tok=hf["num_experts_per_tok"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rope_scaling=yarn_from_hf(hf.get("rope_scaling") or rope, hf.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=hf.get("initializer_range", 0.02),
    )


_YARN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "rope_theta", "truncate"}


def yarn_from_hf(rope: dict[str, Any] | None, max_positions: int) -> YarnScaling | None:
    """YarnScaling from HF's `rope_scaling` / `rope_parameters` dict (None for default RoPE); ValueError for a
    RoPE type or YaRN option this model does not implement (an explicit attention factor or mscale, no truncate)."""
    rope = rope or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (expected 'default' or 'yarn')")
    extra = sorted(k for k, v in rope.items() if k not in _YARN_KEYS and v is not None)
    if extra or rope.get("truncate", True) is not True:
        raise ValueError(f"config.json: YaRN options {extra or ['truncate']} are not supported (expected factor, "
                         "original_max_position_embeddings, beta_fast, beta_slow)")
    return YarnScaling(factor=float(rope["factor"]),
                       original_max_position_embeddings=int(rope.get("original_max_position_embeddings", max_positions)),
                       beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0))


def yarn_to_hf(yarn: YarnScaling | None) -> dict[str, Any] | None:
    """HF's `rope_scaling` dict of `yarn` (None for plain RoPE)."""
    if yarn is None:
        return None
    return {"rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
            "original_max_position_embeddings": yarn.original_max_position_embeddings}


def config_to_hf(cfg: ModelConfig, *, dtype: torch.dtype) -> dict[str, Any]:
    """config.json dict readable by transformers 4.x (num_experts, rope_theta) and 5.x (rope_parameters)."""
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers), "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": yarn_to_hf(cfg.rope_scaling),
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(yarn_to_hf(cfg.rope_scaling) or {})},
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None, "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def _weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it, from the shard index or the single safetensors file."""
    if (path / INDEX_NAME).exists():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    if (path / SINGLE_NAME).exists():
        with safe_open(path / SINGLE_NAME, framework="pt") as f:
            return {name: path / SINGLE_NAME for name in f.keys()}
    raise FileNotFoundError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


class _TensorSource:
    """Reads named tensors out of the checkpoint's files (each opened once), remembering which were used."""

    def __init__(self, files: dict[str, Path], stack: contextlib.ExitStack) -> None:
        self.files, self.used = files, set()
        self._handles = {p: stack.enter_context(safe_open(p, framework="pt")) for p in sorted(set(files.values()))}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ValueError(f"checkpoint: missing tensor {name!r}")
        self.used.add(name)
        return self._handles[self.files[name]].get_tensor(name)


    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of one tensor, read without the rest (safetensors slices)."""
        if name not in self.files:
            raise ValueError(f"checkpoint: missing tensor {name!r}")
        self.used.add(name)
        return self._handles[self.files[name]].get_slice(name)[start:stop]


@contextlib.contextmanager
def row_reader(path: str | os.PathLike) -> Iterator[Callable[[ModelConfig, str, int, int], torch.Tensor]]:
    """A reader of HF checkpoint `path` that returns rows [start, stop) along dim 0 of one of *our* tensors
    (stacked experts: experts start..stop-1, read per expert), so that a rank loads only its own FSDP2 shard."""
    with contextlib.ExitStack() as stack:
        src = _TensorSource(_weight_files(Path(path)), stack)

        def read(cfg: ModelConfig, name: str, start: int, stop: int) -> torch.Tensor:
            if not name.endswith(("mlp.experts.w13", "mlp.experts.w2")):
                return src.rows(name, start, stop)
            prefix, which = name.rsplit(".", 1)
            fused = f"{prefix}.gate_up_proj" if which == "w13" else f"{prefix}.down_proj"
            if src.has(fused):
                return src.rows(fused, start, stop)
            if which == "w2":
                return torch.stack([src.get(f"{prefix}.{e}.down_proj.weight") for e in range(start, stop)])
            return torch.stack([torch.cat([src.get(f"{prefix}.{e}.gate_proj.weight"),
                                           src.get(f"{prefix}.{e}.up_proj.weight")]) for e in range(start, stop)])

        yield read


def _expert_tensor(src: _TensorSource, prefix: str, which: str, num_experts: int) -> torch.Tensor:
    """Stacked w13 or w2 of one MoE layer from fused or per-expert HF tensors."""
    fused = f"{prefix}.gate_up_proj" if which == "w13" else f"{prefix}.down_proj"
    if src.has(fused):
        return src.get(fused)
    if which == "w2":
        return torch.stack([src.get(f"{prefix}.{e}.down_proj.weight") for e in range(num_experts)])
    return torch.stack([torch.cat([src.get(f"{prefix}.{e}.gate_proj.weight"), src.get(f"{prefix}.{e}.up_proj.weight")])
                        for e in range(num_experts)])


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a HF Qwen3-MoE checkpoint directory (its config.json; no weights read)."""
    return config_from_hf(json.loads((Path(path) / "config.json").read_text()))


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> MoEModel:
    """MoEModel from a HF Qwen3-MoE directory. dtype None: the config's dtype, else float32.

    Strict: a missing tensor or an unused one (other than rotary caches) is a ValueError.
    """
    path = Path(path)
    hf_cfg = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf_cfg)
    if dtype is None:
        dtype = DTYPES.get(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32", torch.float32)
    model = MoEModel(cfg, seed=None, dtype=dtype, device="meta")
    state: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        src = _TensorSource(_weight_files(path), stack)
        for name, param in model.state_dict().items():
            if name.endswith(("mlp.experts.w13", "mlp.experts.w2")):
                prefix, which = name.rsplit(".", 1)
                t = _expert_tensor(src, prefix, which, cfg.num_experts)
            elif name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            else:
                t = src.get(name)
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint: tensor {name!r} expected shape {list(param.shape)}, got {list(t.shape)}")
            state[name] = t.to(device=device or "cpu", dtype=dtype)
        unused = sorted(n for n in set(src.files) - src.used if not n.endswith("rotary_emb.inv_freq"))
        if unused:
            raise ValueError(f"checkpoint: {len(unused)} tensors this model does not use, e.g. {unused[:5]}")
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def hf_items(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One of our tensors under its HF name(s): stacked experts split per expert (views of `t`), others as they are;
    [] for a tied LM head (HF checkpoints store it once, as the embedding)."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return []
    if name.endswith("mlp.experts.w13"):
        prefix, f = name.rsplit(".", 1)[0], cfg.moe_intermediate_size
        return [item for e in range(cfg.num_experts)
                for item in ((f"{prefix}.{e}.gate_proj.weight", t[e, :f]), (f"{prefix}.{e}.up_proj.weight", t[e, f:]))]
    if name.endswith("mlp.experts.w2"):
        prefix = name.rsplit(".", 1)[0]
        return [(f"{prefix}.{e}.down_proj.weight", t[e]) for e in range(cfg.num_experts)]
    return [(name, t)]


def hf_state_dict(model: MoEModel) -> dict[str, torch.Tensor]:
    """Our weights under HF per-expert names (fresh contiguous CPU tensors, safe for safetensors)."""
    out = {}
    for name, t in model.state_dict().items():
        for hf_name, part in hf_items(model.config, name, t.detach().cpu()):
            out[hf_name] = part.contiguous().clone()
    return out


def hf_parameter_views(model: MoEModel) -> dict[str, torch.Tensor]:
    """HF tensor name -> the view of `model`'s parameter that holds it (to load weights in place, name by name)."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.update(hf_items(model.config, name, p.detach()))
    return out


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of a model of this config (from a meta-device model: nothing allocated)."""
    meta = MoEModel(cfg, seed=None, device="meta")
    return {name: tuple(t.shape) for name, t in hf_parameter_views(meta).items()}


def _safetensors_header(names: list[str], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> bytes:
    """The header safetensors writes for these tensors of one dtype (data in name order, JSON padded with spaces
    to 8 bytes), preceded by its length: the bytes `save_file(..., metadata={"format": "pt"})` starts with."""
    size, offset, entries = torch.empty((), dtype=dtype).element_size(), 0, {"__metadata__": {"format": "pt"}}
    for name in names:
        nbytes = math.prod(shapes[name]) * size
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shapes[name]),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _layout(shapes: dict[str, tuple[int, ...]], size: int, max_shard_bytes: int) -> list[list[str]]:
    """Names per shard file: `_shards`' greedy split in name order, from sizes alone."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(shapes):
        nbytes = math.prod(shapes[name]) * size
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def save_pretrained_streamed(cfg: ModelConfig, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             path: str | os.PathLike, *, dtype: torch.dtype, max_shard_bytes: int = 5 * 2**30) -> None:
    """`save_pretrained`'s files, byte for byte, from (HF name, tensor) pairs arriving one at a time in sorted name
    order (`t1core.distributed.iter_hf_tensors(..., sorted_names=True)`): the layout (shards, headers, offsets)
    follows from the shapes alone, so each tensor is written as it arrives and none is kept."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: expected > 0, got {max_shard_bytes}")
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype: expected one of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype=dtype), indent=2) + "\n")
    shapes = hf_shapes(cfg)
    size = torch.empty((), dtype=dtype).element_size()
    shards = _layout(shapes, size, max_shard_bytes)
    files = [SINGLE_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                    for i in range(len(shards))]
    for stale in [*path.glob("model-*-of-*.safetensors"), path / SINGLE_NAME, path / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    expected = iter([(file, names, i) for file, names in zip(files, shards) for i in range(len(names))])
    with contextlib.ExitStack() as stack:
        _write_stream(named_tensors, expected, shapes, dtype, path, stack)
    if len(shards) > 1:
        total = sum(math.prod(s) * size for s in shapes.values())
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _write_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], expected: Iterator[tuple[str, list[str], int]],
                  shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, path: Path,
                  stack: contextlib.ExitStack) -> None:
    """Write each arriving tensor at its place in the planned files (`expected`: file, its names, index)."""
    out = None
    for name, tensor in named_tensors:
        file, names, i = next(expected, (None, [], 0))
        if file is None or name != names[i]:
            raise ValueError(f"named_tensors: expected {names[i] if file else 'no more tensors'!r} next (sorted HF "
                             f"names of the model), got {name!r}")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"named_tensors: {name!r} expected shape {list(shapes[name])}, got {list(tensor.shape)}")
        if i == 0:
            out = stack.enter_context(open(path / file, "wb"))
            out.write(_safetensors_header(names, shapes, dtype))
        out.write(tensor.detach().to(device="cpu", dtype=dtype).contiguous().view(torch.uint8).numpy().tobytes())
    if next(expected, None) is not None:
        raise ValueError("named_tensors: ended before every tensor of the model arrived")


def save_pretrained(model: MoEModel, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors (model.safetensors, or model-0000i-of-0000n + index when sharded)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: expected > 0, got {max_shard_bytes}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = model.lm_head.weight.dtype
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype=dtype), indent=2) + "\n")
    tensors = hf_state_dict(model)
    shards = _shards(tensors, max_shard_bytes)
    for stale in [*path.glob("model-*-of-*.safetensors"), path / SINGLE_NAME, path / INDEX_NAME]:
        stale.unlink(missing_ok=True)  # a previous save with another shard count must not leave files behind
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE_NAME, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
