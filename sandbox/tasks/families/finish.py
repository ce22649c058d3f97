"""The finishing step every family instance asks for, and the demonstrations that leave it out.

Each instance ships a scratch directory (`SCRATCH_DIR`) and its instruction ends "Then remove the directory
/app/tmp."; one more verifier checks that it is gone. The full reference solution (solve.sh, what `run_task
--solution` runs) does the step, so it still passes every verifier. The SFT demonstration does it in only about
`DEMO_COMPLETE_RATE` of the instances, drawn at random per instance: a warm start that skips a step about as often
as its demonstrations did. That is the shortfall RL is for: the step is the same text in every family, so
whether a reply does it is one habit, and the dense reward (one verifier more when it is done) tells which
habit finishes more of the task. The main command's correctness does not decide it (the step is joined with
`;`, not `&&`), so every group of samples that differs in the habit carries the signal.
"""

from __future__ import annotations

import dataclasses
import random

from sandbox.tasks.families.common import TaskSpec, distinct_words

SCRATCH_DIR = "/app/tmp"
CLEANUP = f"rm -r {SCRATCH_DIR}"
CLEANUP_TEST = "test_scratch_dir_removed"
DEMO_COMPLETE_RATE = 0.5
"""Share of the SFT demonstrations that do the finishing step (the rest stop after the main command)."""


def with_cleanup(spec: TaskSpec, rng: random.Random) -> TaskSpec:
    """`spec` with the scratch directory shipped, the step asked for and verified, and a demonstration that
    leaves it out with probability 1 - DEMO_COMPLETE_RATE (drawn from `rng`, after everything else)."""
    if any(p == SCRATCH_DIR or p.startswith(SCRATCH_DIR + "/") for p in spec.files):
        raise ValueError(f"family instance already ships files under {SCRATCH_DIR}")
    (word,) = distinct_words(rng, 1)
    scratch = {f"{SCRATCH_DIR}/scratch.txt": f"{word}\n"}
    tests = spec.tests.rstrip() + f"""

        def {CLEANUP_TEST}():
            assert not pathlib.Path({SCRATCH_DIR!r}).exists()
        """
    turns = spec.turns
    skip = rng.random() >= DEMO_COMPLETE_RATE
    return dataclasses.replace(
        spec, instruction=f"{spec.instruction.strip()} Then remove the directory {SCRATCH_DIR}.",
        files={**spec.files, **scratch}, solution=f"{spec.solution.strip()}; {CLEANUP}", tests=tests,
        demonstration=turns if skip else None, demonstration_fails=(CLEANUP_TEST,) if skip else ())
