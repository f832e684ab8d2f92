"""pagellm's frontend: `LLM` for scripts, `AsyncLLM` for services, the engine-core
clients, tokenization and output processing, the OpenAI server and the CLI. Text lives
here; token ids, KV blocks and tensors live in the engine core. Users import the public
names from `pagellm` itself."""
