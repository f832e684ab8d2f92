"""The built-in demo model and its tokenizer (`pagellm make-model`, `LLM("demo")`): a
small random-weight Hugging Face checkpoint written to disk, a dev and test tool rather
than part of the engine. Imports only `protocol`."""
