"""The layers every family shares: norms, rotary embeddings and their scalings, TP linears,
the gated MLP, attention over the backend seam, and the decoder built from them."""
