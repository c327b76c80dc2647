"""Data: the synthetic multi-hop world, TFDS builders for local files, tokenizers."""
