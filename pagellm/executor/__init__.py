"""Runs the model, in three layers that import one way, each only the one below:

- the process layer here (`executor.py`, `multiproc.py`, `worker_proc.py`,
  `worker_node.py`): how the engine core reaches one worker per tensor-parallel rank;
- `worker/`: one rank's work (the worker, model runner, input batch, sampler, CUDA
  graphs, memory, the weight updates it receives);
- `model/`: the model itself (config, loader, decoder, attention, linear layers, RoPE,
  tensor-parallel groups). A new model family is a module here.
"""
