"""Pure planning: lengths, world size and limits in; a plan out. No torch, no runtime, no training config."""
