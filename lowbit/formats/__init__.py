"""Formats: reading and writing quantized tensors in other tools' layouts (ggml's blocks,
GGUF files).  Nothing here chooses how to quantize: a lowbit scheme that maps exactly
onto a format is stored as it is, anything else is converted with its error reported."""
