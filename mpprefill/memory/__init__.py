"""Memory: the KV pool, slot allocators and the radix prefix cache."""
