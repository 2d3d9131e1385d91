"""GGUF weights in their own formats: the file's tensors memory-mapped as raw blocks (``reader``), each
block format's dequantizer (``quants`` for the 32-element formats and the float passthroughs,
``kquants`` for the 256-element K-quants), and the registry that maps a tensor's format to its block
layout and dequantizer (``registry``); ``projection`` multiplies by a tensor's blocks in bounded tiles,
and ``names`` reads a file as a Hugging Face checkpoint (config, tensor names, llama's q/k row order)
without transformers. Nothing loads a model through this package yet."""
