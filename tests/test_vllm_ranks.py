"""rollout.engine='vllm' under a multi-rank (FSDP2-sharded) trainer, on 2 gloo ranks against tests/fake_vllm.py.

Colocated: every rank owns its own engine and runs every other episode. Disaggregated: rank 0 owns the one engine,
runs every episode and broadcasts the trajectories (t1core.rollout_ranks). Checked against references the
multi-rank path does not produce itself: the drift against each engine's own completion log, each engine's weights
against the trainer's consolidated checkpoint (torch.equal), the trajectories of the two layouts against each
other, and the bytes a weight sync held at once (measured on the storages it streamed) against one FSDP unit's.
What was run against a real vLLM: nothing here (see bench/gpu_check_vllm.py).
"""

from __future__ import annotations

import datetime
import json
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout import vllm_api
from t1core.distributed import DataParallel
from t1core.rollout_ranks import RolloutRanks
from tests.machine import free_port, needs_docker

WORLD = 2


# ---- placement and layout (no ranks) ----
def test_engine_gpus_place_each_layout_or_say_why_not() -> None:
    gpus = vllm_api.engine_gpus
    cuda = torch.device
    assert gpus(cuda("cuda:3"), placement="colocated", tensor_parallel_size=1, local_world_size=4,
                device_count=8) == [3]
    # one process: vLLM keeps GPUs 0 .. tp-1 when the trainer sits above them (what vLLM picks unpinned)
    assert gpus(cuda("cuda:2"), placement="disaggregated", tensor_parallel_size=2, device_count=4) == [0, 1]
    # torchrun, 4 local ranks on cuda:0..3: rank 0's engine takes the GPUs after them
    assert gpus(cuda("cuda:0"), placement="disaggregated", tensor_parallel_size=4, local_world_size=4,
                device_count=8) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 .* 8 GPU\(s\) and its 8 trainer ranks .* leaving 0"):
        gpus(cuda("cuda:0"), placement="disaggregated", tensor_parallel_size=8, local_world_size=8, device_count=8)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: a colocated engine"):
        gpus(cuda("cuda:0"), placement="colocated", tensor_parallel_size=2, device_count=8)
    with pytest.raises(ValueError, match="run.device='cuda'"):
        gpus(cuda("cpu"), placement="colocated", tensor_parallel_size=1, device_count=0)
    with pytest.raises(ValueError, match="vllm.placement"):
        gpus(cuda("cuda:0"), placement="remote", tensor_parallel_size=1, device_count=1)


def test_visible_gpus_pins_through_an_inherited_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7,2")
    with vllm_api.visible_gpus([1, 3]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,2"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6,7,2"
    with pytest.raises(ValueError, match="not all visible"):
        with vllm_api.visible_gpus([4]):
            pass
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with vllm_api.visible_gpus([0]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_rollout_ranks_split_the_episodes() -> None:
    items = list(range(7))
    every = [RolloutRanks(dp=DataParallel(rank=r, world_size=3), single_engine=False) for r in range(3)]
    assert [x.mine(items) for x in every] == [[0, 3, 6], [1, 4], [2, 5]]
    assert all(x.owns_engine and x.parallel(2) == 2 for x in every)
    one = [RolloutRanks(dp=DataParallel(rank=r, world_size=3), single_engine=True) for r in range(3)]
    assert [x.mine(items) for x in one] == [items, [], []]
    assert [x.owns_engine for x in one] == [True, False, False] and one[1].parallel(2) == 6
    assert one[0].parallel(None) is None
    single = RolloutRanks(dp=DataParallel.single(), single_engine=False)
    assert single.mine(items) == items and single.gather(items, 7) == items


def test_make_engine_gives_engines_to_the_owning_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from t1core.rollout_ranks import RolloutRanks, make_engine
    from t1core.config_toml import load_config
    from t1model.model import ModelConfig, MoEModel
    from tests import fake_vllm

    monkeypatch.setattr(vllm_api, "load_vllm", fake_vllm.fake_api)
    monkeypatch.setattr(vllm_api, "require_vllm", fake_vllm.require)
    policy = MoEModel(ModelConfig.tiny(), seed=0)
    disagg = load_config(None, ["--rollout.engine=vllm", "--vllm.placement=disaggregated"])
    assert make_engine(policy, disagg, DataParallel(rank=1, world_size=2)) is None
    assert RolloutRanks.for_run(disagg, DataParallel(rank=1, world_size=2)).single_engine
    assert not RolloutRanks.for_run(disagg, DataParallel.single()).single_engine  # one process: as before
    colo = load_config(None, ["--rollout.engine=vllm"])
    with make_engine(policy, colo, DataParallel(rank=1, world_size=2)) as engine:
        assert engine.placement == "colocated" and engine._llm.args["distributed_executor_backend"] is None
        assert not RolloutRanks.for_run(colo, DataParallel(rank=1, world_size=2)).single_engine
    ray = load_config(None, ["--rollout.engine=vllm", "--vllm.placement=disaggregated", "--vllm.executor=ray"])
    with make_engine(policy, ray, DataParallel(rank=0, world_size=2)) as engine:
        assert engine._llm.args["distributed_executor_backend"] == "ray" and not engine._llm.args["enable_sleep_mode"]
    with pytest.raises(ValueError, match="vllm.executor: expected 'mp' with vllm.placement='colocated'"):
        load_config(None, ["--rollout.engine=vllm", "--vllm.executor=ray"])


# ---- 2 gloo ranks through the trainer ----
class _StorageMeter:
    """Bytes of the distinct storages a weight stream has yielded that are still alive (held by the stream, the
    engine or its transport), and their peak."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def wrap(self, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in stream:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
            del storage
            yield name, t


def _rank(rank: int, port: int, args: list[str], out: str) -> None:
    """One trainer rank as torchrun starts it, with the fake vLLM in place; records the peak bytes of every weight
    sync and, at close, this rank's engine weights."""
    import torch.distributed as dist

    from t1core import rollout_ranks, train
    from tests import fake_vllm

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A short collective timeout: a rank left waiting fails the test instead of hanging it (init_from_env keeps it).
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    vllm_api.load_vllm = fake_vllm.fake_api
    vllm_api.require_vllm = fake_vllm.require
    peaks: list[int] = []
    sync, close = train.Trainer.sync_engine, train.Trainer.close
    real_iter = rollout_ranks.iter_hf_tensors  # the stream the sync reads (RolloutRanks.sync_policy)

    def metered_sync(self: train.Trainer) -> None:
        meter = _StorageMeter()
        rollout_ranks.iter_hf_tensors = lambda *a, **k: meter.wrap(real_iter(*a, **k))
        try:
            sync(self)
        finally:
            rollout_ranks.iter_hf_tensors = real_iter
        peaks.append(meter.peak)

    def recording_close(self: train.Trainer) -> None:
        engine = None
        if self.engine is not None:
            engine = {"version": self.engine.policy_version, "requests": self.engine.stats["requests"],
                      "weights": {k: v.clone() for k, v in self.engine._llm.model.state_dict().items()}}
        torch.save({"peaks": peaks, "engine": engine}, Path(out) / f"rank{rank}.pt")
        close(self)

    train.Trainer.sync_engine, train.Trainer.close = metered_sync, recording_close
    assert train.main(args) == 0


def _train_on_two_ranks(tmp_path: Path, tasks: Path, placement: str, extra: tuple[str, ...] = ()) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path / (placement + "".join(extra))
    args = ["--out", str(out), f"--tasks.source={tasks}", "--rollout.engine=vllm", f"--vllm.placement={placement}",
            "--run.steps=2", "--rollout.episodes_per_step=4", "--rollout.group_size=2",
            "--rollout.concurrency=2", "--rollout.max_turns=2", "--rollout.max_new_tokens_per_turn=8",
            "--rollout.max_tokens=640", "--algo.minibatch_tokens=700", "--warmstart.pretrain_steps=0",
            "--warmstart.sft_epochs=0", "--warmstart.critic_steps=0", "--run.checkpoint_every=0",
            "--algo.actor_push=center", "--optim.lr_actor=1e-3", *extra]
    out.mkdir(parents=True)
    mp.spawn(_rank, args=(free_port(), args, str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.torchrun
@pytest.mark.docker
@pytest.mark.slow
@needs_docker
def test_two_ranks_train_with_vllm_colocated_and_disaggregated(tmp_path: Path) -> None:
    """2 steps on 2 FSDP2 ranks with each placement: zero drift; every engine ends holding exactly the trainer's
    weights; a sync never held more than about one layer; both layouts sample the same trajectories."""
    from rollout.trajectory import load_trajectories
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks
    from t1core.checkpoint.save import load_checkpoint
    from t1core.distributed import _unit_groups
    from t1model.hf_io import load_pretrained
    from t1model.model import ModelConfig, MoEModel

    tasks = tmp_path / "tasks"
    family_tasks(tasks, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    units = [sum(p.numel() * p.element_size() for _, p in g) for g in _unit_groups(MoEModel(ModelConfig.tiny()))]
    runs = {}
    for placement in ("colocated", "disaggregated"):
        out = _train_on_two_ranks(tmp_path, tasks, placement)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["tito/drift_tokens"] for r in rows if "tito/drift_tokens" in r] == [0.0, 0.0], placement
        trainer = load_checkpoint(out / "checkpoints", restore_rng=False)["policy"]  # the consolidated shards
        export = load_pretrained(out / "final", dtype=torch.float32).state_dict()  # streamed by checkpoint.hf.save_hf
        assert all(torch.equal(export[k], trainer[k]) for k in trainer)
        ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
        owners = [r for r in ranks if r["engine"] is not None]
        assert len(owners) == (WORLD if placement == "colocated" else 1), placement
        for rec in owners:
            weights = rec["engine"]["weights"]
            assert weights.keys() == trainer.keys()
            assert all(torch.equal(weights[k], trainer[k]) for k in trainer), placement
            assert rec["engine"]["version"] == 2  # one sync after each step's update
            assert rec["engine"]["requests"] > 0  # every engine served episodes
        for rec in ranks:
            assert len(rec["peaks"]) == 2 and all(0 < p <= max(units) for p in rec["peaks"]), (rec["peaks"], units)
            assert max(rec["peaks"]) < sum(units) / 2
        runs[placement] = [load_trajectories(out / "trajectories" / f"step_{s:04d}") for s in (0, 1)]
        print(f"{placement}: peak bytes held by one sync per rank {[max(r['peaks']) for r in ranks]}, largest FSDP "
              f"unit {max(units)}, model {sum(units)}")
    for a_step, b_step in zip(runs["colocated"], runs["disaggregated"]):
        assert len(a_step) == len(b_step) == 4
        for a, b in zip(a_step, b_step):
            assert a.task_name == b.task_name and torch.equal(a.token_ids, b.token_ids)
            assert torch.equal(a.rollout_logprobs, b.rollout_logprobs) and torch.equal(a.routing, b.routing)
            assert a.policy_version == b.policy_version


def test_async_under_torchrun_needs_one_engine_for_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from t1core.config_checks import check_config
    from t1core.config import RunConfig, RolloutSection, VllmSection

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(vllm_api, "require_vllm", lambda: vllm_api.GPU_LINE)
    with pytest.raises(ValueError, match="rollout.max_staleness: expected 0 under torchrun unless one engine"):
        check_config(RunConfig(rollout=RolloutSection(max_staleness=1)))  # a TorchEngine on every rank
    check_config(RunConfig(rollout=RolloutSection(max_staleness=1, engine="vllm"),
                           vllm=VllmSection(placement="disaggregated")))


@pytest.mark.torchrun
@pytest.mark.docker
@pytest.mark.slow
@needs_docker
def test_two_ranks_train_asynchronously_on_one_disaggregated_engine(tmp_path: Path) -> None:
    """rollout.max_staleness=1 on 2 FSDP2 ranks, rank 0's vLLM (the fake) sampling for both while they train: every
    step within the bound with drift 0 (rank 1 trains what rank 0 took, by broadcast), and the engine ends on the
    last version holding exactly the trainer's weights."""
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks
    from t1core.checkpoint.save import load_checkpoint
    from tests.async_checks import async_steps

    tasks = tmp_path / "tasks"
    family_tasks(tasks, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    out = _train_on_two_ranks(tmp_path, tasks, "disaggregated", ("--rollout.max_staleness=1", "--run.steps=3"))
    async_steps(out, 3)
    trainer = load_checkpoint(out / "checkpoints", restore_rng=False)["policy"]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    (owner,) = [r for r in ranks if r["engine"] is not None]
    assert owner["engine"]["version"] == 3 and owner["engine"]["requests"] > 0
    assert all(torch.equal(owner["engine"]["weights"][k], trainer[k]) for k in trainer)
