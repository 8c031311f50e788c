"""Pure functional ops on arrays: attention variants, memories, the gated delta rule (`recurrent`), their ring versions."""
