"""Checkpoints, one concept in one folder. A run enters through `resume`: `checkpoint` (save the run's state),
`resume` (load it back), the KL anchor (`frozen_copy`, `anchor_from_hf`) and WARMSTART_DIR.

    resume.py  the run's checkpoint and resume: models, optimizers, RNGs and TrainerState; the KL anchor
    save.py    atomic step directories under RUN_DIR/checkpoints (sharded runs: DCP, any world size)
    rng.py     the RNG states a checkpoint captures and a resume restores
    hf.py      the policy in HF format: run exports with the tokenizer (export_policy), policy_hf/ beside each
               checkpoint, streamed one layer at a time when sharded (save_hf)
"""
