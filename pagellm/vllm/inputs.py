"""vLLM's `vllm.inputs`: the prompt forms."""

from pagellm.frontend.input_processor import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
