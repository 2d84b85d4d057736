"""Convert rules, one module per op family: each turns an observed BPU node into its fixed-point module."""
