"""Error-feedback memories, one module each."""
