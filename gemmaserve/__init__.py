"""gemmaserve: a validated spec for serving Gemma 4 with vLLM, and the plan derived from it."""
