"""One tensor-parallel rank: the `Worker` the executor calls, its model runner (input
batch, step buffers, sampler, CUDA graphs), its memory (KV-cache sizing, sleep and wake)
and the weight updates it receives. Imports `executor.model`, never the process layer."""
