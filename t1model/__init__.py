"""T1's model floor: the Qwen3-MoE policy and critic with routing replay, attention, the tokenizer and HF
checkpoint I/O. Imports only `t1kernels` below it; rollout engines and the trainer build on it."""
