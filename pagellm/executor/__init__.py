"""Runs the model: weight loading, the decoder, the model runner and the sampler."""
