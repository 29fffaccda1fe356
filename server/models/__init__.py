"""Model architectures: one file per architecture over shared layers."""
