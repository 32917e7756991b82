"""The decode receiver: the KV destination (receiver), its settings (args), its command
line (cli), its `--verify` check (verify) and its test-only delay (delay)."""
