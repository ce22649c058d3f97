"""Standalone check of `rollout.vllm_engine.VLLMEngine` against a real vLLM (0.33.x) on one CUDA GPU.

Run from the repository root on a machine with `pip install -e ".[gpu]"`:  python bench/gpu_check_vllm.py
(`--fake` runs the same checks on CPU over tests/fake_vllm.py: a smoke test of this script, not a vLLM check;
tests/test_vllm_engine.py runs it that way so the script does not rot.)

A tiny Qwen3-MoE checkpoint with a dense layer (bf16) is served by vLLM; the trainer's model holds the same
weights on the same device.
  1. tito       the prompt and sampled ids round-trip exactly (turn 2 = turn 1 + reply + glue); stop on a stop
                id (the stop id is the last token) and length at max_new_tokens.
  2. logprobs   vLLM's sampled-token log-probs against the trainer's recompute with vLLM's routing replayed
                (R3), at T = 0.7 and 1.0: mean and max |diff| within bf16 tolerance.
  3. routing    vLLM's routing of every token against the trainer's own top-k (no replay): agreement >= 95% of
                (token, MoE layer) decisions; ids in range, dense layer dropped.
  4. prefix     turn 2 of a conversation is served partly from the prefix cache, and its prompt routing of turn
                1's tokens equals what turn 1 returned, bit for bit.
  5. update     greedy output after update_weights (streamed HF chunks) equals a fresh engine started on the new
                weights; policy_version advances. The update runs inside a 2-rank gloo world whose other rank never
                joins a collective (a trainer rank under torchrun): the colocated sender must not gather or barrier
                over the default process group (vLLM's own IPC trainer engine does; it would wait here until the
                check's 120 s timeout).
Prints one line per check and a summary; exits 1 when a check fails, 77 (skipped) when vLLM is not installed here
(bench/gpu_run.sh reports the part as skipped). --dry-run prints the plan as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import t1model.cpu_threads  # noqa: E402,F401  (thread settings before torch)
import torch  # noqa: E402

from t1kernels.logprob import token_logprobs  # noqa: E402
from rollout.config import VllmSection  # noqa: E402
from rollout.engine import Completion, SamplingParams  # noqa: E402
from rollout.vllm_engine import VLLMEngine, VLLMSettings  # noqa: E402
from bench import Verdicts  # noqa: E402
from t1model.hf_io import hf_state_dict  # noqa: E402
from t1model.model import ModelConfig, MoEModel  # noqa: E402

VERDICTS = Verdicts()
record = VERDICTS.record
CFG = ModelConfig.tiny().replace(num_hidden_layers=4, mlp_only_layers=(1,))  # L = 4, L_moe = 3


def build(model: MoEModel, args: argparse.Namespace) -> VLLMEngine:
    section = VllmSection(gpu_memory_utilization=args.mem, enforce_eager=True)
    return VLLMEngine.from_model(model, VLLMSettings(vllm=section, max_model_len=512, dtype=args.dtype, seed=0))


def check_tito(engine: VLLMEngine) -> None:
    prompt = list(range(300, 340))
    first = engine.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)).result()
    turn2 = prompt + first.token_ids + [13, 14, 15]
    second = engine.submit(turn2, SamplingParams(temperature=1.0, max_new_tokens=12, seed=2,
                                                 prompt_routing_from=len(prompt) + len(first.token_ids))).result()
    greedy = engine.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=6)).result()
    stop_id = greedy.token_ids[2]
    stopped = engine.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                   stop_token_ids=(stop_id,))).result()
    ok = (first.finish_reason == "length" and len(first.token_ids) == 12 and len(second.token_ids) >= 1
          and stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_id
          and stopped.token_ids == greedy.token_ids[:len(stopped.token_ids)])
    record("tito echo and stop/length", ok, f"reply {len(first.token_ids)} tokens ({first.finish_reason}), stop at "
           f"{len(stopped.token_ids)} on id {stop_id}, turn 2 cached {second.num_cached_tokens}")


def replayed_logprobs(model: MoEModel, prompt: list[int], comp: Completion, temperature: float) -> torch.Tensor:
    ids = torch.tensor(prompt + comp.token_ids, device=model.lm_head.weight.device)
    routing = torch.cat([comp.prompt_routing, comp.routing]).to(ids.device)
    with torch.no_grad():
        hidden_TD = model(ids, replay_routing=routing)
        logp = token_logprobs(hidden_TD[:-1].float(), model.lm_head.weight.float(), ids[1:], temperature=temperature)
    return logp[len(prompt) - 1:].cpu()


def check_logprobs(engine: VLLMEngine, trainer: MoEModel, tol_mean: float, tol_max: float) -> None:
    for temp in (0.7, 1.0):
        diffs = []
        for seed in range(4):
            prompt = [(7 * seed + j) % 3000 + 20 for j in range(24 + 8 * seed)]
            comp = engine.submit(prompt, SamplingParams(temperature=temp, max_new_tokens=32, seed=seed)).result()
            diffs.append((replayed_logprobs(trainer, prompt, comp, temp) - comp.logprobs).abs())
        d = torch.cat(diffs)
        record(f"log-probs vs trainer (R3) T={temp}", d.mean().item() <= tol_mean and d.max().item() <= tol_max,
               f"mean |diff| {d.mean().item():.2e} max {d.max().item():.2e} over {d.numel()} tokens "
               f"(tolerance {tol_mean:g} / {tol_max:g})")


def check_routing(engine: VLLMEngine, trainer: MoEModel) -> None:
    same = total = 0
    for seed in range(4):
        prompt = [(11 * seed + j) % 3000 + 20 for j in range(40)]
        comp = engine.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed)).result()
        ids = torch.tensor(prompt + comp.token_ids, device=trainer.lm_head.weight.device)
        with torch.no_grad():
            _, own_TLK = trainer(ids, return_routing=True)
        vllm_TLK = torch.cat([comp.prompt_routing, comp.routing])
        same += int((own_TLK.cpu().sort(-1).values == vllm_TLK.sort(-1).values).all(-1).sum())
        total += vllm_TLK.shape[0] * vllm_TLK.shape[1]
    record("routing agreement with the trainer", same >= 0.95 * total,
           f"{same}/{total} = {same / total:.1%} of (token, MoE layer) top-k sets (need >= 95%)")


def check_prefix(engine: VLLMEngine) -> None:
    prompt = [(5 * j) % 3000 + 50 for j in range(70)]
    first = engine.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=16, seed=9)).result()
    turn2 = prompt + first.token_ids + [21, 22, 23, 24]
    second = engine.submit(turn2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=10)).result()
    before = torch.cat([first.prompt_routing, first.routing])
    ok = second.num_cached_tokens > 0 and torch.equal(second.prompt_routing[:before.shape[0]], before)
    record("multi-turn prefix cache keeps turn 1's routing", ok,
           f"{second.num_cached_tokens} of {len(turn2)} prompt tokens cached, {before.shape[0]} rows compared")


SKIPPED = 77
"""Exit status of a check that cannot run here (automake's convention; bench/gpu_run.sh reports it as skipped)."""
UPDATE_TIMEOUT_S = 120


def _idle_rank(port: int, done: mp.synchronize.Event) -> None:
    """Rank 1 of a 2-rank gloo world that joins no collective until `done`."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=UPDATE_TIMEOUT_S + 60))
    done.wait(UPDATE_TIMEOUT_S + 60)
    dist.destroy_process_group()


@contextmanager
def trainer_world() -> Iterator[None]:
    """This process as rank 0 of a 2-rank default process group, the other rank idle (a torchrun trainer's world,
    in which the engine's sender must not run collectives of its own)."""
    import torch.distributed as dist
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    other = ctx.Process(target=_idle_rank, args=(port, done), daemon=True)
    other.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=UPDATE_TIMEOUT_S + 60))
    try:
        yield
    finally:
        dist.destroy_process_group()
        done.set()
        other.join(30)


def check_update(engine: VLLMEngine, args: argparse.Namespace) -> None:
    new = MoEModel(CFG, seed=7, dtype=args.dtype)
    prompts = [[(13 * i + j) % 3000 + 30 for j in range(20 + i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    result: dict[str, object] = {}

    def update() -> None:
        try:
            result["version"] = engine.update_weights(hf_state_dict(new).items())
        except Exception as e:  # reported as the check's failure below
            result["error"] = e

    with trainer_world():
        worker = threading.Thread(target=update, daemon=True)
        worker.start()
        worker.join(UPDATE_TIMEOUT_S)
    if worker.is_alive() or "error" in result:
        why = result.get("error", f"still running after {UPDATE_TIMEOUT_S} s (waiting in a default-group collective?)")
        record("update_weights inside a 2-rank trainer world", False, str(why))
        return
    record("update_weights inside a 2-rank trainer world", True, "the idle rank was never waited for")
    version = result["version"]
    after = [c.token_ids for c in engine.generate(prompts, greedy)]
    engine.close()  # one vLLM instance at a time on the GPU
    with build(new, args) as fresh:
        expected = [c.token_ids for c in fresh.generate(prompts, greedy)]
    record("greedy after update_weights == fresh engine", version == 1 and after == expected,
           f"version {version}, {sum(a == b for a, b in zip(after, expected))}/{len(prompts)} replies equal")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fake", action="store_true", help="CPU smoke test over tests/fake_vllm.py (no vLLM)")
    ap.add_argument("--mem", type=float, default=0.3, help="vLLM gpu_memory_utilization")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    args = ap.parse_args()
    print(json.dumps(dict(script="vllm", fake=args.fake, model=dict(layers=CFG.num_hidden_layers,
                                                                    moe_layers=list(CFG.moe_layer_ids)),
                          checks=["tito", "logprobs", "routing", "prefix", "update", "trainer_world"],
                          update_timeout_s=UPDATE_TIMEOUT_S)), flush=True)
    if args.dry_run:
        return 0
    if args.fake:
        from rollout import vllm_api
        from tests import fake_vllm
        vllm_api.load_vllm = fake_vllm.fake_api
        vllm_api.require_vllm = fake_vllm.require
        args.dtype, device, tol = torch.float32, "cpu", (1e-5, 1e-4)
    else:
        try:
            import vllm
        except ImportError as e:
            print(f"SKIPPED: vLLM is not installed here ({e}); nothing was checked against a real vLLM. Install it "
                  "on the device (pip install -e '.[gpu]', vllm>=0.33,<0.34) and rerun.", flush=True)
            return SKIPPED
        print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
        args.dtype, device, tol = torch.bfloat16, "cuda", (2e-2, 0.25)  # bf16 weights, different kernels
    model = MoEModel(CFG, seed=0, dtype=args.dtype)
    trainer = MoEModel(CFG, seed=0, dtype=args.dtype).to(device).eval()
    engine = build(model, args)
    try:
        for check in (lambda: check_tito(engine), lambda: check_logprobs(engine, trainer, *tol),
                      lambda: check_routing(engine, trainer), lambda: check_prefix(engine),
                      lambda: check_update(engine, args)):
            check()
    finally:
        engine.close()
    return VERDICTS.summary()


if __name__ == "__main__":
    sys.exit(main())
