"""The decode server (server): the KV destination (receiver), its links to the prefills'
bootstrap endpoints (prefill_links), the generation loop (generate), its settings (args),
the `mpprefill decode` command (command), its `--verify` check (verify) and its test-only
transfer delay (delay)."""
