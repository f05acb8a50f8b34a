"""Where weights come from: built-in shapes, named real models, GGUF files, the converted-model cache, tokenizers."""
