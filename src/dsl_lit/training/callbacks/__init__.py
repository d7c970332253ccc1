"""Training callbacks: throughput/MFU and expert load now; NaN guards and EMA later."""
