"""T1's model layer (model, attention, tokenizer, HF checkpoints) and trainer (the rest)."""
