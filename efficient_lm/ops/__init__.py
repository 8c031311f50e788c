"""Pure functional ops on arrays: attention variants, memories, their ring versions."""
