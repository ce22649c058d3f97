"""The run config: defaults, TOML round trip, typed overrides, validation errors."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest

from sandbox.tasks import suite
from t1core.config import AlgoSection, RunConfig, TasksSection, num_fields, resolved
from t1config.toml import parse_override
from t1core.config_toml import config_to_toml, format_config, load_config
from t1model.tokenizer import ChatTokenizer, format_tool_call


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_default_is_a_tiny_cpu_run():
    cfg = load_config(None, [])
    assert cfg == RunConfig()
    assert cfg.run.device == "cpu" and cfg.model.name == "tiny"
    assert cfg.rollout.episodes_per_step == 16 and cfg.rollout.group_size == 4
    assert cfg.rollout.max_turns <= 8 and cfg.rollout.max_new_tokens_per_turn <= 512
    assert 1 <= cfg.run.steps <= 32  # with ~16 s per step on 2 cores, inside the 15-minute budget


def test_default_reply_cap_fits_every_builtin_reference_reply(tmp_path: Path):
    # A reply cut at the cap is an unclosed tool call: a task whose reference reply is longer cannot be solved
    # (the tiny default once capped at 48 tokens, and two families with 57-65-token replies scored 0).
    tok = ChatTokenizer.builtin()
    tasks = suite.train_tasks(tmp_path / "train", num_per_family=3, seed=0)
    fam, fixed = suite.heldout_tasks(tmp_path / "heldout", num_per_family=3, seed=0)
    lengths = {t.name: max(len(tok.encode(format_tool_call(call))) + 1 for call in suite.reference_turns(t))
               for t in tasks + fam + fixed}
    longest = max(lengths, key=lengths.__getitem__)
    assert RunConfig().rollout.max_new_tokens_per_turn >= lengths[longest], (longest, lengths[longest])


def test_every_field_has_help_and_is_printed():
    cfg = RunConfig()
    text = format_config(cfg, with_help=True)
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f.metadata["help"].strip(), f"{section.name}.{f.name} has no help"
            assert f"{section.name}.{f.name} " in text
            assert f.metadata["help"] in text
    assert "algo.icepop" in format_config(cfg) and "none" in format_config(cfg)


def _section_reads(tree: ast.AST, sections: set[str]) -> set[tuple[str, str]]:
    """(section, name) for every `<ref>.name` in a module where <ref> is a section: `cfg.sandbox.pids`, an alias
    (`r, s = cfg.rollout, cfg.sandbox` then `s.pids`) or a name equal to the section (a parameter `algo`)."""
    alias = {sec: sec for sec in sections}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                for t, v in pairs:
                    if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr in sections:
                        alias[t.id] = v.attr
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            ref = node.value
            if isinstance(ref, ast.Attribute) and ref.attr in sections:
                out.add((ref.attr, node.attr))
            elif isinstance(ref, ast.Name) and ref.id in alias:
                out.add((alias[ref.id], node.attr))
    return out


def test_every_field_is_read_outside_the_config():
    """No option that silently does nothing: each field is read as `<section>.field` somewhere outside config.py
    (`cfg.sandbox.pids`, an alias `s = cfg.sandbox` then `s.pids`, a parameter `algo` then `algo.gamma`), or through
    a method of its section (`cfg.tasks.base_image_map()` reads base_image_overrides). Static, so it cannot prove
    that a value is used well; it caught four sandbox.* fields and a run.* field that nothing read."""
    root = Path(__file__).resolve().parents[1]
    cfg = RunConfig()
    sections = {f.name for f in dataclasses.fields(cfg)}
    reads: set[tuple[str, str]] = set()
    for pattern in ("t1core/**/*.py", "rollout/**/*.py", "sandbox/**/*.py"):
        for path in root.glob(pattern):
            if path.name != "config.py":
                reads |= _section_reads(ast.parse(path.read_text()), sections)
    methods = {}  # public method of a section class -> the self.<field> names it reads
    for section in sections:  # each section's class, wherever it is defined (beside its component's code)
        cls = ast.parse(textwrap.dedent(inspect.getsource(type(getattr(cfg, section))))).body[0]
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")):
            methods[fn.name] = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
    reads |= {(sec, name) for sec, method in list(reads) if method in methods for name in methods[method]}
    unread = [f"{sec}.{f.name}" for sec in sections for f in dataclasses.fields(getattr(cfg, sec))
              if (sec, f.name) not in reads]
    assert not unread, f"config fields nothing reads: {sorted(unread)}"


def test_toml_round_trip_with_non_defaults(tmp_path):
    cfg = load_config(None, [
        "--model.name=/ckpt/Qwen3 \"MoE\"\\x",  # quotes and backslashes survive
        "--algo.icepop=[0.5, 5]", "--algo.tis_cap=none", "--algo.value_clip_eps=none",
        "--optim.lr_actor=3e-7", "--optim.betas=0.8,0.99", "--model.dtype=bfloat16",
        "--tasks.families=fix_script,git_ops", "--tasks.base_image_overrides=debian:*=t1-base,python:*=t1-py",
        "--warmstart.sft_epochs=0", "--run.steps=3",
    ])
    text = config_to_toml(cfg)
    assert "# " in text  # help comments
    again = load_config(_write(tmp_path, text), [])
    assert again == cfg
    assert again.algo.icepop == (0.5, 5.0) and again.algo.tis_cap is None
    assert again.model.name == '/ckpt/Qwen3 "MoE"\\x'
    assert again.tasks.base_image_map() == {"debian:*": "t1-base", "python:*": "t1-py"}


def test_overrides_are_typed_and_win_over_toml(tmp_path):
    path = _write(tmp_path, "[algo]\ngamma = 0.9\nclip_eps = 0.1\n[run]\nseed = 5\n")
    cfg = load_config(path, ["--algo.gamma=0.99", "--run.device=cuda:1", "--rollout.batch_invariant=0",
                             "--rollout.temperature=1", "--warmstart.sft_max_steps=7"])
    assert cfg.algo.gamma == 0.99 and cfg.algo.clip_eps == 0.1 and cfg.run.seed == 5
    assert cfg.run.device == "cuda:1" and cfg.rollout.batch_invariant is False
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.warmstart.sft_max_steps == 7
    assert load_config(path, ["--tasks.families="]).tasks.families == ()
    assert parse_override("--a.b=c=d") == ("a", "b", "c=d")


@pytest.mark.parametrize("override,message", [
    ("--algo.gama=0.9", r"unknown key algo.gama; valid keys of \[algo\]: \['gamma'"),
    ("--optimizer.lr=1", r"unknown section 'optimizer'; valid sections: \['algo'"),
    ("--run.steps", "expected '--section.key=value'"),
    ("run.steps=3", "expected '--section.key=value'"),
    ("--run.steps=abc", "run.steps: expected int, got 'abc'"),
    ("--run.steps=2.5", "run.steps: expected int, got '2.5'"),
    ("--rollout.batch_invariant=maybe", "expected a bool"),
    ("--algo.gamma=1.5", r"algo.gamma: expected in \(0, 1\], got 1.5"),
    ("--algo.icepop=2,5", "algo.icepop: expected"),
    ("--algo.icepop=0.5", "expected 2 items"),
    ("--rollout.top_p=0", "rollout.top_p"),
    ("--run.device=tpu", "run.device"),
    ("--tasks.base_image_overrides=debian", "PATTERN=IMAGE"),
    ("--rollout.group_size=3", "rollout.group_size: expected >= 1 and a divisor of episodes_per_step"),
    ("--rollout.group_size=1", "algo.actor_push: expected a rule without the group baseline"),
    ("--algo.actor_push=positive", "algo.actor_push: expected one of 'group_positive'"),
    ("--vllm.nccl_endpoint=10.0.0.1", "vllm.nccl_endpoint: expected 'HOST:PORT'"),
    ("--warmstart.sft_epochs=-1", "warmstart.sft_epochs: expected >= 0"),
    ("--algo.minibatch_tokens=100", "algo.minibatch_tokens: expected >= rollout.max_tokens"),
    ("--sandbox.pids=8", r"sandbox.pids: expected >= 16"),
    ("--sandbox.cpus=0", r"sandbox.cpus: expected > 0 or none"),
    ("--sandbox.memory_mb=8", r"sandbox.memory_mb: expected >= 16 or none"),
    ("--sandbox.output_cap_bytes=100", r"sandbox.output_cap_bytes: expected >= 256"),
])
def test_bad_overrides_raise_with_expected_and_got(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_sandbox_minimums_match_the_sandbox(tmp_path):
    """The run's [sandbox] section and each sandbox's settings share one minimum: a value one below is refused by
    both, the minimum itself accepted by each and carried from one to the other (`SandboxSettings.for_run`)."""
    from sandbox.runtime.settings import MIN_OUTPUT_CAP, MIN_PIDS, SandboxSettings
    with pytest.raises(ValueError, match=f"pids must be >= {MIN_PIDS}"):  # checked before any daemon is reached
        SandboxSettings(pids=MIN_PIDS - 1)
    with pytest.raises(ValueError, match=f"output_cap must be >= {MIN_OUTPUT_CAP}"):
        SandboxSettings(output_cap=MIN_OUTPUT_CAP - 1)
    lowest = load_config(None, [f"--sandbox.pids={MIN_PIDS}", f"--sandbox.output_cap_bytes={MIN_OUTPUT_CAP}"])
    task = suite.train_tasks(tmp_path, num_per_family=1, seed=0)[0]
    settings = SandboxSettings.for_run(task, lowest.sandbox)
    assert (settings.pids, settings.output_cap) == (MIN_PIDS, MIN_OUTPUT_CAP)
    for field, low in (("pids", MIN_PIDS), ("output_cap_bytes", MIN_OUTPUT_CAP)):
        with pytest.raises(ValueError, match=f"sandbox.{field}: expected >= {low}"):
            load_config(None, [f"--sandbox.{field}={low - 1}"])


def test_bad_toml_values(tmp_path):
    with pytest.raises(ValueError, match="unknown key"):
        load_config(_write(tmp_path, "[run]\nstepz = 3\n"), [])
    with pytest.raises(ValueError, match=r"run.steps: expected int, got 3.0"):
        load_config(_write(tmp_path, "[run]\nsteps = 3.0\n"), [])
    with pytest.raises(ValueError, match="rollout.batch_invariant: expected bool, got 1"):
        load_config(_write(tmp_path, "[rollout]\nbatch_invariant = 1\n"), [])
    with pytest.raises(ValueError, match=r"expected \[run\] to be a table"):
        load_config(_write(tmp_path, "run = 3\n"), [])
    assert load_config(_write(tmp_path, "[algo]\ngamma = 1\n"), []).algo.gamma == 1.0  # an int is a float


def test_sections_are_frozen_and_keyword_only():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.algo.gamma = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        AlgoSection(0.5)  # type: ignore[misc]
    with pytest.raises(ValueError, match="tasks.families: expected"):
        TasksSection(families=["a"])  # type: ignore[arg-type]
    assert dataclasses.replace(cfg.algo, gamma=0.5).gamma == 0.5


def test_bitwise_auto_resolves_into_a_copy():
    cfg = load_config(None, [])
    assert cfg.algo.bitwise == "auto" and resolved(cfg).algo.bitwise == "on"  # the default CPU run
    assert cfg.algo.bitwise == "auto"  # the loaded config itself is never changed
    assert resolved(resolved(cfg)) == resolved(cfg)
    for off in ("--run.device=cuda", "--rollout.batch_invariant=false", "--model.dtype=bfloat16"):
        assert resolved(load_config(None, [off])).algo.bitwise == "off", off
    assert resolved(load_config(None, ["--algo.bitwise=off"])).algo.bitwise == "off"
    for bad, name in (("--run.device=cuda", "run.device"), ("--model.dtype=bfloat16", "model.dtype"),
                      ("--rollout.batch_invariant=false", "rollout.batch_invariant")):
        with pytest.raises(ValueError, match=f"{name}: expected .* with algo.bitwise='on'"):
            load_config(None, ["--algo.bitwise=on", bad])
    with pytest.raises(ValueError, match="algo.bitwise: expected one of 'auto', 'on', 'off'"):
        load_config(None, ["--algo.bitwise=yes"])


def test_the_config_stays_within_its_field_budget():
    """Issue 48 set 90 fields in all. Issues 55-58 added five (tasks.fixed_tasks, tasks.decontaminate, sandbox.hosts,
    rollout.infra_retries, rollout.r3) and brought it to 93; issue 59 folded three (RETIRED, below) back to 90."""
    assert num_fields() == sum(len(dataclasses.fields(getattr(RunConfig(), f.name))) for f in dataclasses.fields(
        RunConfig()))
    assert num_fields() <= 90, num_fields()


RETIRED = [("tasks", "train_seed", 0), ("tasks", "rl_seed", 1), ("tasks", "heldout_seed", 100000),
           ("algo", "advantage_norm", "group"), ("algo", "negative_adv_scale", 1.0), ("algo", "skip_flat_steps", True),
           ("algo", "skip_flat_groups", True), ("algo", "critic_only_iterations", 3), ("algo", "use_tito", True),
           ("algo", "use_r3", True), ("warmstart", "pretrain_seed_block", 2), ("warmstart", "sft_enabled", False),
           ("warmstart", "sft_lr_decay", False), ("optim", "actor_lr_decay", False),
           ("vllm", "max_model_len", "none"), ("vllm", "nccl_address", "10.0.0.2"), ("vllm", "nccl_port", 29700),
           ("parallel", "nodes", 3), ("parallel", "gpus_per_node", 8), ("parallel", "gpu_mem_gib", 80.0),
           ("parallel", "host_mem_gib", 900.0), ("run", "eval_every", 3), ("run", "eval_temperature", 0.5),
           ("run", "eval_samples", 0),
           ("eval", "temperature", 0.0), ("tasks", "rl_fixed_tasks", True), ("vllm", "dtype", "float32")]
"""The 24 fields config_compat read into their replacements until issue 59 retired it, then the three issue 59
folded (eval.temperature: the greedy attempt is greedy, `t1core.evaluation.GREEDY`; tasks.rl_fixed_tasks:
tasks.fixed_tasks='rl'; vllm.dtype: vLLM serves model.dtype): each is an unknown key now."""


@pytest.mark.parametrize("section,key,value", RETIRED)
def test_a_retired_field_is_an_unknown_key(tmp_path, capsys, section, key, value):
    toml = f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value).replace(chr(39), chr(34))}"
    for load in (lambda: load_config(_write(tmp_path, f"[{section}]\n{toml}\n"), []),
                 lambda: load_config(None, [f"--{section}.{key}={value}"])):
        with pytest.raises(ValueError, match=rf"unknown key {section}\.{key}; valid keys of \[{section}\]") as e:
            load()
        assert "\n" not in str(e.value)
    assert capsys.readouterr().err == ""  # no `deprecated:` line any more: the error is the one line


def test_shipped_presets_load_without_a_word_on_stderr(capsys):
    root = Path(__file__).resolve().parents[1] / "t1core" / "configs"
    for path in sorted(root.glob("*.toml")):
        load_config(str(path), [])
        assert capsys.readouterr().err == "", path.name


@pytest.mark.parametrize("tool", ["rollout.collect", "rollout.evaluate"])
def test_the_tools_read_the_trainers_sections(tool: str, tmp_path, capsys):
    """rollout.collect and rollout.evaluate take the trainer's TOML file and --section.key=value flags: the same
    [rollout], [sandbox], [context] and [vllm] the trainer builds from them (its other tables left to it); an old
    flag or a section they do not read is one line, exit 2."""
    import importlib

    module = importlib.import_module(tool)
    run = _write(tmp_path, '[rollout]\nmax_turns = 5\nconcurrency = 3\n[sandbox]\npids = 64\nhosts = ["unix:///x.sock"]\n'
                           '[context]\ncompaction = "extractive"\n[algo]\ngamma = 0.9\n')
    flags = ["--rollout.max_tokens=1500", "--vllm.enforce_eager=true"]
    base = ["--checkpoint", "ckpt", "--tasks", "tasks", "--out", "out"] if tool == "rollout.evaluate" else ["--out", "o"]
    _, got = module._parse_args([*base, "--config", run, *flags])
    trainer = load_config(run, flags)
    rollout = trainer.rollout if tool == "rollout.collect" else dataclasses.replace(trainer.rollout, temperature=0.0)
    assert (got.rollout, got.sandbox, got.context, got.vllm) == (rollout, trainer.sandbox, trainer.context,
                                                                 trainer.vllm)
    assert got.rollout.max_turns == 5 and got.sandbox.hosts == ("unix:///x.sock",) and got.rollout.max_tokens == 1500
    for argv, said in ((["--max-turns", "2"], "unrecognised arguments ['--max-turns', '2']"),
                       (["--algo.gamma=0.5"], "unknown section 'algo'"),
                       (["--rollout.max_turnz=2"], "unknown key rollout.max_turnz"),
                       (["--config", str(tmp_path / "none.toml")], "none.toml: no such file")):
        with pytest.raises(SystemExit) as e:
            module._parse_args([*base, *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and said in err[0], err
