"""Weight updates between a trainer and the engine, without pickle: the sender's side
(`sender.py`, what `LLM.update_weights` calls; `nccl.py`'s trainer functions) and what
both sides share (the tensor codec and an update's checks, the shared-memory buffer
format, CUDA IPC handles, the "nccl" group). The engine's receiving side is the
worker's (`executor/worker/weight_receiver.py`). Imports only `protocol`."""
