"""Checkpoints: the Hugging Face port (safetensors <-> params) and orbax whole-state checkpoints.

from trace_jax.checkpoint import load_hf, save_hf, StateCheckpointer
"""

from trace_jax.checkpoint.hf import load_hf, load_orbax, save_hf, save_orbax
from trace_jax.checkpoint.state import StateCheckpointer

__all__ = ["StateCheckpointer", "load_hf", "load_orbax", "save_hf", "save_orbax"]
