"""The oracle of KIVI's window (kv/window.py), written from the rule rather than the formula:
block after block, a complete block is read quantized once keeping it exact would leave more
than R exact tokens."""


def oracle_quantized_len(n: int, residual: int, block_size: int, start: int = 0) -> int:
    quantized = 0
    while quantized + block_size <= n and n - quantized > residual:
        quantized += block_size
    return max(start, quantized)
