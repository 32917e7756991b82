"""The decode server: the KV destination (receiver), the links to prefills (bootstrap), the
generation loop (generate), its settings (args), command line (cli), `--verify` check
(verify) and test-only transfer delay (delay)."""
