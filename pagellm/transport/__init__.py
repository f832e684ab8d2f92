"""The ZeroMQ plumbing both sides of the engine-core socket use: socket setup and the
handshake (`sockets.py`) and CURVE keys (`curve.py`). Imports only `protocol`, so the
frontend reaches the engine core through it without importing `enginecore`."""
