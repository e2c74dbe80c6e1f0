"""Building blocks of the dense decoder: tensor-parallel linears, norms, rotary, activation."""
