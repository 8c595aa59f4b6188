"""The strategies: one module each, over the in-process replica machinery."""
