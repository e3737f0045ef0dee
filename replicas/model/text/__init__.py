"""Text in and out of the model: tokenizers and incremental detokenisation (`tokenizer`), chat
templates rendered as transformers renders them (`chat_template`), and prompts with image markers
(`prompt`).
"""
