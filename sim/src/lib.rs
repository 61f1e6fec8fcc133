//! Simulated CUDA driver (in progress)
