"""The one GPU check (`make test-gpu`): engine parity, training steps, the weight path, decode
speed and a short job, on CUDA at real shapes or on the CPU at small ones."""
