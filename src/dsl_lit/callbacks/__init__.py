"""Training callbacks: throughput/MFU now; expert-bias updates, NaN guards and EMA later."""
