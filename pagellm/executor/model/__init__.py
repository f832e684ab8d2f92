"""The model: its config, the loader that reads a checkpoint into it, the decoder and
its layers (attention over the paged KV cache, linear layers, RoPE) and the
tensor-parallel groups they shard over. Knows nothing of workers or processes."""
