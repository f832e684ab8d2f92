"""How the frontend reaches engine cores: the client classes (`core_client.py`: in
process, or over ZeroMQ to one engine core or several with data parallelism), the
engine-core process they start, DP routing and the node that serves remote DP ranks.
`make_client` (factory.py) picks one."""
