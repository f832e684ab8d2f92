"""vLLM's `vllm.inputs`: the prompt forms, where scripts written for vLLM import them
(`from pagellm.inputs import TokensPrompt`)."""

from pagellm.frontend.input_processor import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
