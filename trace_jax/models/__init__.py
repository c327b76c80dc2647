"""Policy and predictor models (Flax nnx): the Qwen2/Qwen3 decoder and the success predictor."""
