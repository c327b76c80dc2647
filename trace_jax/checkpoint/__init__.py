"""Checkpoints: the Hugging Face port (safetensors <-> params) and orbax train-state checkpoints."""
