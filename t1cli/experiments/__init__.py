"""Reproducible experiments on T1's own stack (each one a module with a `python -m` entry point).

    mismatch     the TITO / R3 ablation: train-vs-rollout log-prob gap and token drift (`run_experiment`;
                 `t1 mismatch`)
    copy_probe   does a checkpoint copy an unseen instruction's command exactly, per built-in family
"""
