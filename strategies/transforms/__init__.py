"""Model transforms that are not parallelisms: LoRA and QLoRA adapters, Mixout, sparsity-accelerated training (SAT), tied weights."""
