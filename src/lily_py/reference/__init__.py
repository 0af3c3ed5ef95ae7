"""NumPy reference implementation of the qwen3_5_moe text model (the oracle for every device).

Written for clarity, float32 math on weights dequantized on the fly; never imports the extension.
"""
