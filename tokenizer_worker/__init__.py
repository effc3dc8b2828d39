"""The tokenizer worker process: text to token ids, chat templates, incremental detokenization, stop strings."""
