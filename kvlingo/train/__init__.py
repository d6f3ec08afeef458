"""Training a translator: the closed-form fit, distillation, checkpoints and the frozen-model checks."""
