"""Triton kernels with plain-torch references beside them.

`t1kernels.moe`: routing (`route`) and the fused MoE expert dispatch (`fused_moe`), driven by a routing tensor
that may be replayed from rollout (R3). `t1kernels.logprob`: log-probabilities of exact token IDs without
materialising the [N, V] logits.
"""
