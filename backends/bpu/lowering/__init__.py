"""BPU lowering rules, one module per op family: each turns a converted node into BPU program ops."""
