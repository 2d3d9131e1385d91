"""GGUF weights in their own formats: the file's tensors memory-mapped as raw blocks (``reader``), each
block format's dequantizer (``quants`` for the 32-element formats and the float passthroughs,
``kquants`` for the 256-element K-quants), and the registry that maps a tensor's format to its block
layout and dequantizer (``registry``). Projection methods over these blocks build on this package."""
