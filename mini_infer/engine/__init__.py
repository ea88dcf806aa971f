"""The engine (chapters 1c-3): sampling, the paged KV cache, its memory plan and
attention, the scheduler, the model runner, `LLMEngine` and `LLM`. `contracts` writes down every
plug-in kind and the step's plain data; `registry` finds plug-ins by name."""
