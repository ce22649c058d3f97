"""The schema language of T1's one typed config tree, below every other floor (plain Python: no torch, no Docker).

Each component defines its own section beside its code with these helpers (the sandbox's in
`sandbox.runtime.settings`, the rollout's, context's and vLLM's in `rollout.config`, the trainer's in
`t1core.config`); `t1core.config.RunConfig` composes them, and `t1config.toml` reads any set of sections from the
same TOML file and `--section.key=value` flags, so the trainer, `rollout.collect` and `rollout.evaluate` share
one name and one default per knob.
"""

from t1config.schema import check, check_types, knob, type_name

__all__ = ["check", "check_types", "knob", "type_name"]
