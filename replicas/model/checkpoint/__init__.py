"""Checkpoints: where a model's weights come from — resolving `--model` (`resolve`: `tiny`, a packaged
model, a GGUF file, a directory), converting GGUF files into a cached checkpoint (`gguf`,
`gguf_tokenizer`), and loading a safetensors checkpoint layer by layer (`loader`).
"""
