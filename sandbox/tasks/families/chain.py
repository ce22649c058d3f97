"""Long-horizon families: an instance takes 100 to 120 shell commands, each one written from the last one's output.

`follow_chain`: the directory /app/q holds one small file per link of a chain; each file holds the path of the next
one (`q/4217`, relative to /app), the last holds `end`. The agent checks the links off one by one with
`tee -a done < q/NAME`: the command prints the file (the next path, which the next command needs) and appends it to
/app/done. The instruction names the first link only, so every later command copies a path out of the previous
observation, and nothing else: each turn's command and output are short and alike, and after compaction the last kept
turn still holds all the agent needs.

A name is four digits because the copy has to be learnable by a 9M model from scratch. The built-in BPE writes every
digit as a token of its own, so a path is always the same six tokens in the output and in the command, and each of
them stands the same distance before its copy in every turn. Names of a letter and two digits (`q/k42`) were four
tokens or five (`/s` merges, `/k` does not): the same tiny model, pretrained on these walks mixed with the short
families' first commands, never learned to copy the letter (5 of 105 calls right after 450 steps), and with digits
it copies 88 of 105 after 300 steps and 97 of 105 after 600 (docs/long-horizon.md).

Verifiers give a dense reward: one per eighth of the chain checked off in order (`MILESTONES`; a repeated line is
forgiven, a skipped or wrong one ends the count), and one that /app/q is left as it was. The full reference walks the
whole chain; the SFT demonstration stops early in about half of the instances, at a random link past the first
quarter (`DEMO_COMPLETE_RATE`), and writes the done marker there: a warm start that quits early about as often as
its demonstrations did, which RL can fix (the reward grows with every link it goes on with).
"""

from __future__ import annotations

import random

from sandbox.tasks.families.common import TaskSpec, sha_of

CHAIN_DIR = "/app/q"
DONE_FILE = "/app/done"
END = "end"
LINKS = (100, 120)
"""Links per instance (inclusive bounds): the commands a full solution runs."""
MILESTONES = 8
"""Progress verifiers: test_progress_k passes when the first k/MILESTONES of the chain are checked off in order."""
DEMO_COMPLETE_RATE = 0.5
"""Share of the SFT demonstrations that walk the whole chain (the rest stop at a random link past the first quarter)."""
NAMES = 10_000
"""Distinct link names: four digits."""
AGENT_TIMEOUT_S = 1800.0
"""task.toml's agent timeout of an instance (a hundred commands and more)."""


def step_command(path: str) -> str:
    """The command that checks off the link at `path` (`q/NAME`; run in /app) and prints the next path."""
    return f"tee -a done < {path}"


def instruction(first: str) -> str:
    """An instance's instruction: it names the first link's path and the command, nothing more."""
    return (f"Follow the chain of files in {CHAIN_DIR}, starting at {first}: run {step_command(first)} , then the "
            f"same command with the path it prints, and so on, until it prints {END}.")


def walk(rng: random.Random, links: int) -> tuple[str, list[tuple[str, str]]]:
    """(instruction, [(command, output), ...]) of a whole walk along a fresh chain of `links` links: what the
    pretraining corpus shows (`t1core.pretrain`), every command copying the path the output before it printed.
    The output is what the sandbox returns for the command (`tee` prints the file: the next path, a newline)."""
    paths = _paths(rng, links)
    return instruction(paths[0]), [(step_command(p), f"{nxt}\n") for p, nxt in zip(paths, [*paths[1:], END])]


def _paths(rng: random.Random, n: int) -> list[str]:
    """n distinct link paths like 'q/4217' (four digits, in q/ under /app)."""
    return [f"q/{i:04d}" for i in rng.sample(range(NAMES), n)]


def follow_chain(rng: random.Random) -> TaskSpec:
    return chain_task(rng, rng.randint(*LINKS))


def chain_task(rng: random.Random, links: int) -> TaskSpec:
    """A `follow_chain` instance of `links` links (at most NAMES, the distinct names there are); longer than the
    family's own for stress runs."""
    if not 1 <= links <= NAMES:
        raise ValueError(f"chain_task: expected 1 to {NAMES} links, got {links}")
    paths = _paths(rng, links)
    contents = [*paths[1:], END]  # what each link's file holds: the next path
    files = {f"/app/{path}": f"{nxt}\n" for path, nxt in zip(paths, contents)}
    turns = tuple(step_command(path) for path in paths)
    stop = rng.randrange(len(paths) // 4, len(paths)) if rng.random() >= DEMO_COMPLETE_RATE else None
    milestones = [-(-len(paths) * k // MILESTONES) for k in range(1, MILESTONES + 1)]  # links done at each
    fails = tuple(f"test_progress_{k}" for k, need in enumerate(milestones, 1) if stop is not None and stop < need)
    tests = "\n".join(f"""
        def test_progress_{k}():
            assert checked_off() >= {need}
        """ for k, need in enumerate(milestones, 1))
    return TaskSpec(
        instruction=instruction(paths[0]),
        files=files, inspect=turns[:-1], solution=turns[-1], category="long",
        constants={"EXPECTED": contents, "DONE": DONE_FILE, "CHAIN": {p: sha_of(c) for p, c in files.items()}},
        demonstration=turns[:stop] if stop is not None else None, demonstration_fails=fails,
        agent_timeout_s=AGENT_TIMEOUT_S,
        tests='''
        def checked_off():
            """Links checked off in order: /app/done's lines, a line repeated at once counted once, up to the first
            line that is not the next expected one."""
            if not pathlib.Path(DONE).is_file():
                return 0
            n, last = 0, None
            for line in read(DONE).split():
                if line == last:
                    continue
                if n == len(EXPECTED) or line != EXPECTED[n]:
                    break
                n, last = n + 1, line
            return n
        ''' + tests + '''
        def test_chain_unchanged():
            assert unchanged(CHAIN)
        ''')
