"""kvlab: measure KV-cache quantization."""
