"""The model (chapters 1-1b): layers that own their weights, the Qwen2/Llama decoder
over them, the tokenizer, and loading from safetensors or GGUF. Knows nothing of requests."""
